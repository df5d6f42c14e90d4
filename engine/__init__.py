"""rollway's CPU stand-in for SGLang: the same HTTP contract served with transformers and continuous
batching (`engine.server`), and the tiny demo model (`engine.tiny_model`)."""
