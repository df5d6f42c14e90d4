"""The trainer's one config object: a dataclass with a docstring under every field (cleanrl style).

Loaded from a TOML or JSON file, then `ROLLWAY_<FIELD>` environment variables (in `rollway train`), then
`--key value` / `--key=value` overrides (dashes or underscores): the later one wins.
Every value is checked against its annotation at load: an unknown key, a wrong type or a value outside a
`Literal` fails before any process is started, never deep inside training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass
class TrainConfig:
    # --- where things are ---
    gateway: str = ""
    """Gateway base URL (http://host:port). Required in RL mode and for SFT from recorded sessions."""
    model: str = ""
    """HF model folder to start from when the gateway serves version 0 (or in SFT mode)."""
    out: str = "rollway-train"
    """Output folder: checkpoints/, weights/ (published HF dirs), metrics.jsonl, tb/, rewards.png."""
    admin_key: str = ""
    """Gateway admin key; empty = the ROLLWAY_ADMIN_KEY environment variable (never written to out/)."""
    mode: Literal["rl", "sft"] = "rl"
    """rl: lease groups and train GRPO-style; sft: supervised fine-tuning on assistant tokens."""

    # --- the run ---
    steps: int = 0
    """Optimizer-step rounds (one lease batch each) before exiting; 0 = run until stopped."""
    seed: int = 0
    """Seed for torch (weight init of nothing here; only dropout, if a model has any)."""
    http_timeout: float = 30.0
    """Seconds for one HTTP call to the gateway (a lease adds its wait_seconds on top)."""
    dist_timeout: float = 1800.0
    """Seconds a collective may wait before the process group fails (gloo and NCCL)."""

    # --- leasing (docs/architecture.md "Leases and training samples" and "Staleness admission") ---
    groups_per_step: int = 8
    """Groups trained per step (B). Filtered groups are replaced by leasing more (AReaL#450)."""
    lease_seconds: float = 300.0
    """Lease length; a background thread renews every lease_seconds/3 until the groups are acked."""
    wait_seconds: float = 30.0
    """Long-poll wait of one lease call. With some groups in hand and none arriving, train on those."""
    max_head_offpolicyness: int = 0
    """AReaL's eta: the gateway hands out no group more than eta versions older than the trainer."""
    dynamic_filter: bool = True
    """Drop groups whose every advantage is zero (all rewards equal): they carry no gradient."""
    train_constrained_turns: bool = False
    """Train the tokens of constrained turns (decoded under a grammar: a forced tool_choice, a response_format).
    Off: they get loss mask 0, as they are samples of the grammar-masked distribution, not of the policy the
    trainer recomputes (docs/http-api.md "Forced tool choice and response_format")."""

    # --- algorithm ---
    lr: float = 1e-6
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    optimizer_steps: int = 1
    """Optimizer steps per leased batch (the batch is cut into this many minibatches)."""
    micro_batch_tokens: int = 8192
    """Padded tokens (rows x longest row) per forward/backward pass on one rank."""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each decoder layer's activations in the backward instead of keeping them (trainer/recompute.py):
    a fraction of the activation memory for ~1.3x the pass's time. auto: only passes of at least
    activation_checkpointing_min_tokens padded tokens (long rows); on: every pass; off: none."""
    activation_checkpointing_min_tokens: int = 8192
    """auto: the padded tokens from which a pass checkpoints (the default micro_batch_tokens: only a row longer
    than a micro-batch's budget, alone in its pass, pays the recompute)."""
    adv_std_norm: bool = False
    """Divide advantages by the group's reward std (GRPO); off by default (Dr. GRPO)."""
    gamma: float | None = None
    """Discount of per-turn rewards to earlier turns in a chain's returns (trainer/advantages.py), recorded with
    each step. Unset: the gateway's deprecated `gamma` when the lease carries one (ROLLWAY_GAMMA), else 1.0."""
    clip_low: float = 0.2
    """PPO clip: ratio floor 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip: ratio ceiling 1 + clip_high (DAPO clip-higher)."""
    behaviour_weight_cap: float = 5.0
    """Cap on the behaviour importance weight exp(proximal - behaviour); 0 disables."""
    behaviour_weight_cap_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: min(w, cap) (TIS); mask: drop tokens whose weight exceeds the cap (AReaL)."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """token_mean: every loss token of the step weighs the same; seq_mean: every sequence does."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference model; 0 = no reference model is loaded."""
    ref_model: str = ""
    """HF folder of the KL reference; empty = --model (else the weights training started from)."""

    # --- checkpoints and publishing ---
    eval_log: str = ""
    """An eval log (`rollway rollout --eval-log`) drawn on the final reward plot, per weight version."""
    checkpoint_every: int = 1
    """Durable checkpoint (model, optimizer, step, version) every K steps. Groups are acked only then."""
    keep_checkpoints: int = 2
    """Training checkpoints kept on disk (oldest removed)."""
    keep_weights: int = 3
    """Published HF weight folders kept on disk (oldest removed; the gateway may still read the last)."""
    weight_sync: Literal["disk", "distributed", "tensor"] = "disk"
    """disk: write an HF folder every server reads at the same path (a shared filesystem); distributed: broadcast
    the weights to every server over torch process groups (no shared disk; NCCL on GPUs, gloo on CPU), with the
    disk path as the fallback when no server takes them; tensor: hand servers on this machine handles to the
    weights' memory (`/update_weights_from_tensor`: CUDA IPC on a GPU, shared memory on CPU), refused across
    machines (docs/scaling.md "Ways to publish", "One device")."""
    weight_sync_address: str = "127.0.0.1"
    """distributed: this host's address as the inference servers reach it (the groups' TCP stores listen here)."""
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """distributed: the collective backend; auto = nccl when CUDA is available, else gloo."""
    weight_sync_bucket_mb: float = 512.0
    """distributed: megabytes per broadcast bucket (one flat tensor, one server call each)."""
    weight_sync_timeout: float = 120.0
    """distributed: seconds each rendezvous, broadcast and server call may take before it fails."""
    release_kv_cache: bool = False
    """Colocated on one device: ask the servers to free their KV cache (`/release_memory_occupation`) for the
    training step and take it back after; generation stalls meanwhile (docs/scaling.md "One device")."""
    weight_sync_catch_up_s: float = 5.0
    """distributed: how often rank 0 asks the gateway for backends that lack the current version (added,
    restarted, failed mid-update) and sends it to them again; 0 = they wait for the next publish."""

    # --- LoRA (trainer/lora.py) ---
    lora_rank: int = 0
    """Train a LoRA adapter of this rank instead of the full weights (0 = full weights). The base stays frozen and
    each publish is the adapter folder only, loaded by the servers next to the base (docs/scaling.md)."""
    lora_alpha: int = 0
    """LoRA alpha (the update is scaled by alpha / rank); 0 = 2 x rank."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    """Comma-separated names of the linear layers the adapter targets (the servers' --lora-target-modules must
    include them)."""

    # --- SFT ---
    sft_data: str = ""
    """SFT: a JSONL file of {"messages": [...]} chats; empty = recorded sessions from GET /v1/sessions."""
    sft_session_state: str = "finished"
    """SFT from sessions: the session state to export."""
    sft_min_reward: float | None = None
    """SFT from sessions: keep only sessions with at least this reward (rejection sampling)."""
    sft_epochs: int = 1
    """SFT: passes over the data (ignored when steps > 0 stops it sooner)."""
    sft_batch_sequences: int = 16
    """SFT: sequences per optimizer step (over all ranks)."""
    sft_stop_at_match: float = 0.0
    """SFT: stop once the model's expected exact-match rate at T = 1 reaches this (0 = off): the probability
    it gives to each whole assistant reply of a probe of the training chats, averaged. An RL warm-up that
    stops here starts RL where groups carry signal. Checked every `sft_eval_every` steps."""
    sft_eval_every: int = 25
    """SFT: steps between two probe measurements (logged as `probe_match`)."""
    sft_probe_sequences: int = 256
    """SFT: how many training chats (the first ones) the probe scores."""
    sft_report_match: bool = False
    """SFT: measure `probe_match` every `sft_eval_every` steps and at the last step without stopping on it (a
    fixed step count that reports where it ended)."""
    sft_max_seconds: float = 0.0
    """SFT: stop after the step that ends past this many seconds of training (0 = no cap): a time cap on a
    step count, for a slow machine. A run that stops on it says so (and at which step)."""

    # --- experiment tracking (besides metrics.jsonl and TensorBoard; off by default) ---
    wandb_project: str = ""
    """Also log every step's metrics to this Weights & Biases project (pip install 'rollway[wandb]'); empty =
    off. Offline (no network, files under OUT/wandb): wandb_mode = "offline" or WANDB_MODE=offline."""
    wandb_mode: str = ""
    """W&B's mode: online | offline | disabled; empty = W&B's own default (WANDB_MODE, else online)."""
    mlflow_tracking_uri: str = ""
    """Also log every step's metrics to MLflow at this tracking URI (pip install 'rollway[mlflow]'): a folder
    (a local store, no server: FOLDER/mlflow.db) or any MLflow tracking URI (sqlite:///FILE, http(s)://host of
    a tracking server); empty = off."""
    mlflow_experiment: str = "rollway"
    """MLflow: the experiment the run is logged under."""
    run_name: str = ""
    """The run's name in W&B and MLflow; empty = the out folder's name."""

    def resolved_admin_key(self) -> str:
        return self.admin_key or os.environ.get("ROLLWAY_ADMIN_KEY", "")

    def validate(self) -> TrainConfig:
        """Checks that relate fields; raises ValueError."""
        if self.mode == "rl" and not self.gateway:
            raise ValueError("mode 'rl' needs --gateway URL")
        if self.mode == "sft" and not (self.sft_data or self.gateway):
            raise ValueError("mode 'sft' needs --sft-data FILE or --gateway URL (recorded sessions)")
        if not self.model and not self.gateway:
            raise ValueError("give --model DIR (or a gateway that serves a published model_path)")
        for name in (
            "groups_per_step",
            "optimizer_steps",
            "micro_batch_tokens",
            "checkpoint_every",
            "sft_batch_sequences",
            "sft_eval_every",
            "sft_probe_sequences",
            "keep_checkpoints",
            "keep_weights",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.weight_sync in ("distributed", "tensor") and self.lora_rank:
            raise ValueError(f"--weight-sync {self.weight_sync} sends full weights; a LoRA adapter is published by path "
                             "(--weight-sync disk): choose one")
        if self.activation_checkpointing_min_tokens < 0:
            raise ValueError("activation_checkpointing_min_tokens must be >= 0")
        if self.lora_rank < 0 or self.lora_alpha < 0:
            raise ValueError("lora_rank and lora_alpha must be >= 0")
        if self.gamma is not None and not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be within [0, 1], got {self.gamma}")
        if self.weight_sync_catch_up_s < 0:
            raise ValueError(f"weight_sync_catch_up_s must be >= 0, got {self.weight_sync_catch_up_s}")
        if self.lora_rank and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ValueError("lora_targets names no layer")
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise ValueError(f"wandb_mode must be online, offline or disabled, got {self.wandb_mode!r}")
        if self.sft_max_seconds < 0:
            raise ValueError(f"sft_max_seconds must be >= 0, got {self.sft_max_seconds}")
        if not 0 <= self.sft_stop_at_match <= 1:
            raise ValueError(f"sft_stop_at_match must be in [0, 1], got {self.sft_stop_at_match}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("clip_low must be in [0, 1) and clip_high >= 0")
        return self

    def to_json(self) -> str:
        """The config as JSON, the admin key left out (it travels in the environment)."""
        d = dataclasses.asdict(self)
        d.pop("admin_key")
        return json.dumps(d, indent=2, sort_keys=True)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` (from TOML/JSON or a CLI string) as the annotated type, or ValueError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"{name}: {value!r} is not one of {list(allowed)}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"{name}: expected an int, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}: expected an int, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{name}: unsupported annotation {hint!r}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _apply(values: dict[str, Any], source: str, into: dict[str, Any]) -> None:
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            if source == "command line":  # the user typed a flag: name it as one, and the flags that exist
                raise ValueError(f"unknown option {_flag(name)} (rollway train --help lists them; known: "
                                 f"{', '.join(_flag(n) for n in sorted(_FIELDS))})")
            raise ValueError(f"{source}: unknown option {key!r} (known: {', '.join(sorted(_FIELDS))})")
        try:
            into[name] = _coerce(name, value, _HINTS[name])
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """`--key value` / `--key=value` / `--flag` (a bare bool flag means true) into a dict of strings."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r} (options look like --key value)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            value = argv[i]
        else:
            value = "true"
        out[key] = value
        i += 1
    return out


ENV_PREFIX = "ROLLWAY_"


def env_values(environ: Mapping[str, str]) -> dict[str, str]:
    """Every field given as `ROLLWAY_<FIELD>` (upper case), e.g. ROLLWAY_GATEWAY, ROLLWAY_LR."""
    return {name: environ[ENV_PREFIX + name.upper()] for name in _FIELDS if ENV_PREFIX + name.upper() in environ}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> TrainConfig:
    """One precedence: command-line overrides > `ROLLWAY_*` environment (when `environ` is given) > the file
    (`.toml` or `.json`; a TOML file may put the keys under `[train]`) > the defaults.

    `rollway train` passes its environment; the workers don't: they read the `out/config.json` that
    `rollway train` wrote, where the environment has already been applied in its place."""
    values: dict[str, Any] = {}
    if path:
        p = Path(path)
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        if set(data) == {"train"} and isinstance(data["train"], dict):
            data = data["train"]
        _apply(data, str(p), values)
    if environ is not None:
        _apply(env_values(environ), "environment", values)
    _apply(overrides or {}, "command line", values)
    return TrainConfig(**values).validate()
