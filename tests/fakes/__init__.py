"""Fakes written for the tests: a scripted SGLang server (`sglang`) and a fast /generate (`fast_backend`)."""
