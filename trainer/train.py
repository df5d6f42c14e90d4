"""rollway's trainer: lease complete groups from the gateway, take a GRPO-style step under FSDP2, write an
HF checkpoint, publish it. One linear loop; rank 0 talks to the gateway and broadcasts to the others.

    torchrun --nproc-per-node N -m trainer.train --config out/config.json [--key value ...]
    (what `rollway train` runs, through trainer.launch.main)

Where this departs from GRPO (Shao et al. 2024, DeepSeekMath):
- Advantage = per-token return - the group's mean session reward, by explicit group id, each session
  counted once however many sequences it produced. No division by the group std by default (Dr. GRPO,
  Liu et al. 2025); `adv_std_norm = true` restores it.
- Decoupled PPO objective (Hilton et al. 2021; AReaL): the clip is around the proximal policy recomputed
  with the pre-update weights, and the behaviour importance weight pi_prox / mu (off-policy samples up to
  eta versions old) is capped. Clip-higher 0.2 / 0.28 (DAPO).
- No KL term by default (DAPO); `kl_coef` adds the k3 estimate to the starting weights.
- Token-mean aggregation over the whole step (DAPO); `loss_agg = "seq_mean"` gives GRPO's per-sequence mean.
- Dynamic filtering (DAPO): zero-advantage groups are acked as "filtered" and refilled by leasing more;
  with some groups in hand and none arriving within `wait_seconds`, the step trains on what it has.
- Logits are divided by each token's sampling temperature, as the inference server did.
- Groups are acked (as part of the publish) only once their update is in a durable checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from trainer.advantages import ScoredGroup, score_group
from trainer.batching import plan_step, rows_of
from trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint, prune_weights, save_checkpoint
from trainer.client import GatewayClient, Lease, LeaseRenewer, StepReporter
from trainer.config import TrainConfig, load_config, parse_overrides
from trainer.fsdp import DistInfo, broadcast, init_distributed, load_sharded_model, shutdown
from trainer.lora import export_adapter, inject, load_adapter, publish_path
from trainer.loss import PPOParams
from trainer.metrics import MetricsSink
from trainer.pipeline import GatewayPipeline
from trainer.plot import plot_rewards
from trainer.step import make_optimizer, rl_step
from trainer.tensor_sync import LiveWeights
from trainer.tracking import tracking_for
from trainer.weight_sync import CatchUp, SyncPayload, sync_options

log = logging.getLogger("trainer")


@dataclass
class StepBatch:
    """What rank 0 broadcasts each round: the groups to train, or why there are none."""

    groups: list[ScoredGroup] = field(default_factory=list)
    leases: dict[str, list[str]] = field(default_factory=dict)
    """batch_id -> ids of its groups that train (acked when the step is durable)."""
    rewards: list[float] = field(default_factory=list)
    """Session rewards of every scored group, filtered ones included: what the policy earns."""
    filtered: int = 0
    filtered_rewards: list[float] = field(default_factory=list)
    """The common reward of each filtered group whose sessions all scored the same (why it was filtered)."""
    stale: int = 0
    staleness: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    gamma: float | None = None
    """The discount its returns were computed with (`lease_gamma`); None: a format 1 lease's, the gateway's."""


def lease_gamma(cfg: TrainConfig, lease: Lease) -> float | None:
    """The trainer's gamma, else the gateway's deprecated one where the lease carries it, else 1.0. None for a
    lease of format 1: its returns come discounted by the gateway."""
    if lease.lease_format < 2:
        return None
    if cfg.gamma is None:
        return 1.0 if lease.gateway_gamma is None else lease.gateway_gamma
    if lease.gateway_gamma is not None and lease.gateway_gamma != cfg.gamma and lease.gateway_gamma not in _WARNED:
        _WARNED.add(lease.gateway_gamma)  # once per value, not once per lease
        log.warning("the gateway sets the deprecated gamma=%g; this trainer's gamma=%g applies", lease.gateway_gamma,
                    cfg.gamma)
    return cfg.gamma


_WARNED: set[float] = set()


def collect(client: GatewayClient, renewer: LeaseRenewer, cfg: TrainConfig, version: int) -> StepBatch:
    """Lease until `groups_per_step` groups survive the filter (or nothing more arrives in wait_seconds)."""
    out, t0 = StepBatch(), time.perf_counter()
    while len(out.groups) < cfg.groups_per_step:
        lease = client.lease(
            max_groups=cfg.groups_per_step - len(out.groups),
            min_groups=cfg.groups_per_step - len(out.groups),  # the rest of the step in one lease, once complete
            lease_seconds=cfg.lease_seconds,
            wait_seconds=cfg.wait_seconds,
            groups_per_step=cfg.groups_per_step,
            max_head_offpolicyness=cfg.max_head_offpolicyness,
            trainer_version=version,
            train_constrained_turns=cfg.train_constrained_turns,
        )
        out.stale += lease.dropped_stale if lease else 0
        if lease is None or not lease.groups:
            break  # train on what we have (maybe nothing: the loop asks again)
        renewer.hold(lease.batch_id)
        filtered: dict[str, str] = {}
        out.gamma = gamma = lease_gamma(cfg, lease)
        for group in lease.groups:
            scored = score_group(group, cfg.adv_std_norm, 1.0 if gamma is None else gamma)
            out.rewards.extend(scored.rewards)
            if not scored.samples or (cfg.dynamic_filter and scored.filtered):
                filtered[group.group_id] = "filtered"
                if scored.samples and scored.rewards and max(scored.rewards) == min(scored.rewards):
                    out.filtered_rewards.append(scored.rewards[0])
                continue
            out.groups.append(scored)
            out.leases.setdefault(lease.batch_id, []).append(group.group_id)
            out.staleness += [version - v for s in scored.samples for v in s.versions if v >= 0]
        out.filtered += len(filtered)
        if filtered:  # frees their admission slots now, so refill groups can start (docs/architecture.md)
            client.ack(lease.batch_id, filtered)
        if lease.batch_id not in out.leases:
            renewer.release(lease.batch_id)
    out.wait_s = time.perf_counter() - t0
    return out


def idle_note(batch: StepBatch, cfg: TrainConfig) -> str:
    """Why a lease round brought nothing to train, in words, and what to change (the trainer then waits)."""
    head = f"no trainable group within {cfg.wait_seconds:.0f}s"
    if batch.filtered:
        equal = batch.filtered_rewards
        parts = []
        if equal:
            values = sorted(set(equal))
            shown = ", ".join(f"{v:g}" for v in values[:3]) + (", ..." if len(values) > 3 else "")
            parts.append(f"{'all ' if len(equal) == batch.filtered else ''}{len(equal)} of {batch.filtered} "
                         f"filtered group(s) had equal rewards in every session ({shown}): GRPO learns nothing "
                         "from a group whose sessions all score the same")
        if batch.filtered > len(equal):
            parts.append(f"{batch.filtered - len(equal)} group(s) had no sample to train (no rewarded session with "
                         "completion tokens)")
        if equal and max(equal) <= 0:
            advice = ("the policy never earns a reward on these tasks: start from a model that sometimes succeeds "
                      "(e.g. the weights of `rollway demo`'s warm-up, rollway-demo/sft/weights/sft-final, for its "
                      "arithmetic tasks), or give easier tasks or a graded reward")
        elif equal and min(equal) > 0 and len(set(equal)) == 1:
            advice = "every session succeeds alike: give harder tasks"
        else:
            advice = "more samples per group (--n-samples) make a spread of rewards likelier"
        return f"{head}: {'; '.join(parts)}. {advice}; waiting"
    if batch.stale:
        return (f"{head}: {batch.stale} group(s) dropped as stale (generated more than max_head_offpolicyness="
                f"{cfg.max_head_offpolicyness} versions before this trainer's): raise --max-head-offpolicyness; "
                "waiting")
    return (f"{head}: no complete group arrived (a group is leased once each of its sessions is finished with a "
            "reward): are agents running and finishing their sessions?; waiting")


def _send(client: GatewayClient, version: int, path: Path | SyncPayload, batch_ids: list[str] | None,
          results: dict[str, str | int]) -> int:
    if isinstance(path, SyncPayload):  # --weight-sync distributed: broadcast over process groups
        return path.publish(client, version, batch_ids or [], results)
    return client.publish(version, publish_path(path), batch_ids, results)


def commit(
    client: GatewayClient,
    renewer: LeaseRenewer,
    held: dict[str, dict[str, int]],
    version: int,
    path: Path | SyncPayload,
    durable: bool,
) -> dict[str, dict[str, int]]:
    """Publish `version`. If the step is durable, every held batch is acked inside the publish (one
    transaction with the version bump), each group with the version its update first went into (`held`: batch
    id -> {group id: version}). Returns what is still held."""
    if not durable or not held:
        _send(client, version, path, None, {})
        return held
    _send(client, version, path, list(held), {g: v for groups in held.values() for g, v in groups.items()})
    for batch_id in held:
        renewer.release(batch_id)
    return {}


def _next_batch(pipe: GatewayPipeline[StepBatch] | None, version: int) -> tuple[StepBatch, float]:
    assert pipe is not None  # rank 0 only (on_rank0)
    return pipe.next_batch(version)


def _publish(pipe: GatewayPipeline[StepBatch] | None, held: dict[str, dict[str, int]], version: int,
             path: Path | SyncPayload, durable: bool) -> tuple[dict[str, dict[str, int]], float]:
    assert pipe is not None
    return pipe.publish(held, version, path, durable)


def _wait_publish(pipe: GatewayPipeline[StepBatch] | None) -> float:
    assert pipe is not None
    return pipe.wait_publish()


T = TypeVar("T")


def on_rank0(info: DistInfo, what: str, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` on rank 0 and hand its result to every rank. If it raises, every rank raises (the others
    would otherwise wait in the next collective until the process group times out)."""
    result: Any = None
    error: BaseException | None = None
    if info.is_main:
        try:
            result = fn(*args)
        except Exception as e:  # re-raised below, on every rank
            error = e
    result, message = broadcast((result, None if error is None else f"{type(error).__name__}: {error}"))
    if message is not None:
        raise RuntimeError(f"{what} failed on rank 0: {message}") from error
    return cast(T, result)


def run_rl(cfg: TrainConfig, info: DistInfo) -> None:
    out = Path(cfg.out).resolve()
    client = GatewayClient(cfg.gateway, cfg.resolved_admin_key(), cfg.http_timeout) if info.is_main else None
    renewer: LeaseRenewer | None = None
    sink = MetricsSink(out, enabled=info.is_main, total_steps=cfg.steps or None, tracking=tracking_for(cfg, info.is_main))
    pipe: GatewayPipeline[StepBatch] | None = None
    # each step's figures and advantages go to the gateway's store (the viewer's charts), off this thread
    reporter = StepReporter(client) if client is not None else None
    # --weight-sync distributed: backends that lack the current version get it again from rank 0 (no folder to load)
    catch_up = (CatchUp(client, cfg.weight_sync_catch_up_s).start()
                if client is not None and cfg.weight_sync in ("distributed", "tensor") and cfg.weight_sync_catch_up_s > 0
                else None)
    try:
        # ---------------- starting weights: the served version, else --model; then our last checkpoint
        gw_version, gw_path = on_rank0(info, "reading GET /v1/weights", GatewayClient.current_weights, client)
        source = gw_path if gw_path and Path(gw_path).is_dir() else cfg.model
        # LoRA: the adapter is injected before the wrap; the base is --model (a served adapter is no model folder)
        model = load_sharded_model(source, info, prepare=(lambda m: inject(m, cfg, source)) if cfg.lora_rank else None,
                                   recompute=cfg.activation_checkpointing,
                                   recompute_min_tokens=cfg.activation_checkpointing_min_tokens)
        ref_source = cfg.ref_model or cfg.model or source  # not the latest published weights after a restart
        ref_model = load_sharded_model(ref_source, info, trainable=False) if cfg.kl_coef > 0 else None
        optimizer = make_optimizer(model, cfg)
        # --weight-sync tensor, one rank: the servers may read the parameters themselves (no gather copy); each
        # optimizer step first waits until they have (trainer/tensor_sync.py LiveWeights)
        live = LiveWeights() if cfg.weight_sync == "tensor" and info.world_size == 1 else None
        if live is not None:
            optimizer.register_step_pre_hook(live.before_step)
        step, version = 0, gw_version
        ckpt = latest_checkpoint(out / "checkpoints")
        if ckpt is not None:
            step, ckpt_version = load_checkpoint(model, optimizer, ckpt, trainable_only=bool(cfg.lora_rank))
            version = max(ckpt_version, gw_version)
        elif cfg.lora_rank and gw_path and gw_path.startswith("lora:"):
            load_adapter(model, gw_path.removeprefix("lora:"))  # no checkpoint: go on from the served adapter
        params = PPOParams(
            cfg.clip_low, cfg.clip_high, cfg.behaviour_weight_cap, cfg.behaviour_weight_cap_mode, cfg.kl_coef
        )
        sink.note(
            f"trainer: {info.world_size} rank(s) on {info.device}, from {source} (step {step}, "
            f"version {version}{', checkpoint ' + str(ckpt) if ckpt else ''})"
        )
        renewer = LeaseRenewer(client, cfg.lease_seconds) if client else None
        if client is not None and renewer is not None:  # rank 0: leases and publishes off the training thread
            lease_client, lease_renewer = client, renewer
            pipe = GatewayPipeline(
                lambda v: collect(lease_client, lease_renewer, cfg, v),
                lambda held, v, path, durable: commit(lease_client, lease_renewer, held, v, path, durable),
            )
        held: dict[str, dict[str, int]] = {}  # leases whose update is not yet in a durable checkpoint

        while cfg.steps == 0 or step < cfg.steps:
            # ---------------- lease (rank 0, prefetched during the last step); every rank gets the same groups
            batch, lease_wait = on_rank0(info, "leasing", _next_batch, pipe, version)
            if pipe is not None and (cfg.steps == 0 or step + 1 < cfg.steps):
                pipe.prefetch(version + 1)  # the next step's batch, leased while this one trains
            if not batch.groups:
                sink.note(idle_note(batch, cfg))
                continue

            # ---------------- train: proximal pass, then forward/backward + optimizer step(s)
            t0 = time.perf_counter()
            plan = plan_step(
                [rows_of(g) for g in batch.groups],
                world_size=info.world_size,
                rank=info.rank,
                optimizer_steps=cfg.optimizer_steps,
                micro_batch_tokens=cfg.micro_batch_tokens,
                loss_agg=cfg.loss_agg,
            )
            released = cfg.release_kv_cache  # the same on every rank: on_rank0 is collective
            if released:  # colocated: the servers' KV cache is freed for the step (generation stalls meanwhile)
                on_rank0(info, "releasing the servers' KV cache", GatewayClient.memory, client, "release", ["kv_cache"])
            try:
                metrics = rl_step(
                    model, optimizer, plan, params, max_grad_norm=cfg.max_grad_norm, device=info.device,
                    ref_model=ref_model,
                )  # fmt: skip
            finally:
                if released:
                    on_rank0(info, "resuming the servers' KV cache", GatewayClient.memory, client, "resume",
                             ["kv_cache"])
            if released:
                metrics["kv_cache_released_s"] = time.perf_counter() - t0
            step_time = time.perf_counter() - t0
            step += 1
            version += 1

            # ---------------- durable checkpoint (every K steps and the last), HF export, publish + ack
            durable = step % cfg.checkpoint_every == 0 or step == cfg.steps
            t1 = time.perf_counter()
            if durable:
                save_checkpoint(
                    model,
                    optimizer,
                    out / "checkpoints",
                    step=step,
                    version=version,
                    keep=cfg.keep_checkpoints,
                    trainable_only=bool(cfg.lora_rank),
                )
            t2 = time.perf_counter()
            path: Path | SyncPayload
            if cfg.lora_rank:  # only the adapter is published (trainer/lora.py)
                path = export_adapter(model, cfg, source, out / "adapters" / f"v{version:06d}")
            elif cfg.weight_sync in ("distributed", "tensor"):  # gathered on rank 0, sent by the publish thread
                path = SyncPayload.gather(model, source, sync_options(cfg, out, catch_up, live))
            else:
                path = export_hf(model, source, out / "weights" / f"v{version:06d}")
            t3 = time.perf_counter()
            for batch_id, group_ids in batch.leases.items():
                held.setdefault(batch_id, {}).update(dict.fromkeys(group_ids, version))
            # the publish runs while the next step trains (after the previous publish, which is waited for here)
            held, publish_wait = on_rank0(
                info, f"publishing version {version}", _publish, pipe, held, version, path, durable
            )
            if durable:  # its acks ride on this publish: done before the step is, as without the pipeline, so a
                # trainer killed after a checkpoint leaves it unpublished only within the step, never a step later
                publish_wait += on_rank0(info, f"publishing version {version}", _wait_publish, pipe)
            if info.is_main:
                prune_weights(out / "weights", cfg.keep_weights)
                prune_weights(out / "adapters", cfg.keep_weights)

            # ---------------- what to look at
            rewards = batch.rewards
            metrics.update(
                reward_mean=statistics.fmean(rewards) if rewards else 0.0,
                reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                reward_n=len(rewards),  # sessions behind the mean: the reward plot's confidence band
                groups_accepted=len(batch.groups),
                groups_filtered=batch.filtered,
                groups_stale=batch.stale,
                staleness_mean=statistics.fmean(batch.staleness) if batch.staleness else 0.0,
                staleness_max=max(batch.staleness, default=0),
                version=version,
                tokens=sum(len(s.token_ids) for g in batch.groups for s in g.samples),
                step_time_s=step_time,
                checkpoint_time_s=t2 - t1,
                export_time_s=t3 - t2,
                publish_wait_s=publish_wait,  # blocked on the previous version's publish
                publish_time_s=pipe.last_publish_s if pipe else 0.0,  # the last finished one, on its thread
                lease_wait_s=lease_wait,  # blocked on this step's batch (leased while the last step trained)
                lease_time_s=batch.wait_s,  # the lease calls themselves, on their thread
            )
            if batch.gamma is not None:
                metrics["gamma"] = batch.gamma  # returns were discounted with it (trainer/advantages.py)
            metrics["tokens_per_s"] = metrics["tokens"] / max(step_time, 1e-9)
            metrics["lr"] = float(optimizer.param_groups[0]["lr"])
            if renewer and renewer.errors:
                sink.note(f"lease renew errors: {renewer.errors[-3:]}")
                renewer.errors.clear()
            sink.log(step, metrics)
            if reporter is not None:
                reporter.report(step, version, metrics, batch.groups)
        on_rank0(info, "publishing the last version", _wait_publish, pipe)
    finally:
        if pipe is not None:
            pipe.close()
        if renewer:
            renewer.close()
        if reporter is not None:
            reporter.close()
        if catch_up is not None:
            catch_up.close()
        if client:
            client.close()
        sink.close()
        if info.is_main and sink.jsonl_path.exists() and sink.jsonl_path.stat().st_size > 0:  # a step to plot
            plot_rewards(sink.jsonl_path, out / "rewards.png", cfg.eval_log or None)


def setup_logging() -> None:
    """INFO for the trainer's own lines. The gateway client's HTTP library only from WARNING up: httpx logs
    every request at INFO, and a lease, renew or publish every few seconds is not worth a line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    if "--config" in args:
        i = args.index("--config")
        config_file = args[i + 1]
        del args[i : i + 2]
    cfg = load_config(config_file, parse_overrides(args))
    setup_logging()
    # SIGTERM (torchrun forwards it; `rollway demo` stops the trainer with it) unwinds like Ctrl-C, so the
    # metrics are flushed and the reward plot is written. Held leases simply expire back to the queue.
    stopped: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        stopped.append(signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    info = init_distributed(cfg.dist_timeout)
    torch.manual_seed(cfg.seed)
    try:
        if cfg.mode == "sft":
            from trainer.sft import run_sft

            run_sft(cfg, info)
        else:
            run_rl(cfg, info)
        # Every rank leaves together after a normal end, with no collective of a peer still in flight: a rank
        # that tore down early once aborted at exit ("terminate called without an active exception", gloo, CI).
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    except SystemExit:
        if not stopped:
            raise
        # Stopped: the metrics, checkpoints and the plot are written (the finally blocks above ran). Exit now,
        # not after the interpreter joins the leasing thread, which may sit in a lease's long poll for up to
        # wait_seconds (issue 28: `rollway train` took 22 s to stop); its lease expires back to the queue.
        shutdown()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + stopped[0])
    finally:
        shutdown()


if __name__ == "__main__":
    main()
