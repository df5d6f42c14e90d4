"""benchmarks/loop.py's report: the figures across seeds, both configurations side by side, the per-seed
table and details, and the medians and spreads across seeds."""

from __future__ import annotations

import importlib.metadata
import statistics
from typing import Any

from loop_common import ENGINE_MAX_BATCH, THRESHOLDS, WINDOW_S

from rollway.demo import GROUPS_IN_FLIGHT, N_SAMPLES

OTHER_WARN_PCT = 10.0  # other work's share of the machine above which the report warns


def ratio_bound(a: float | None, b: float | None, budget: float) -> str | None:
    """When one side reached the threshold and the other did not within the budget: the bound on the ratio."""
    if a is not None and b is None:
        return f"<{a / budget:.3f}"
    if a is None and b is not None:
        return f">{budget / b:.3f}"
    return None


def spread(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4),
            "n": len(vals)}


def across(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for thr in THRESHOLDS:
        out[f"ratio_ttt_{thr}"] = spread([s.get(f"ratio_ttt_{thr}") for s in results])
    for side in ("rollway", "trl"):
        done = [s for s in results if s.get(side)]
        out[f"seeds_{side}"] = len(done)
        out[f"heldout_end_{side}"] = spread([s[side]["heldout_end"] for s in done])
        out[f"heldout_gain_{side}"] = spread([s[side]["heldout_end"] - s["heldout_start"] for s in done])
        for thr in THRESHOLDS:
            out[f"ttt_{thr}_{side}"] = spread([s[side][f"ttt_{thr}"] for s in done])
        if done:
            out[f"cpu_{side}"] = {k: spread([s[side]["cpu"].get(k) for s in done]) for k in done[0][side]["cpu"]}
    return out


def config_rows(r: dict[str, Any] | None, t: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    c = (r or {}).get("config", {})
    k = (t or {}).get("config", {})

    def rw(fmt: str) -> str:
        return fmt.format(**c) if c else "-"

    def tr(fmt: str) -> str:
        return fmt.format(**k) if k else "-"

    return [
        ("learning rate", rw("{lr:g} constant, AdamW betas ({adam_beta1}, {adam_beta2}) wd {weight_decay}"),
         tr("{lr:g} {lr_schedule}, {optimizer} betas ({adam_betas[0]}, {adam_betas[1]}) wd {weight_decay}")),
        ("grad clip (norm)", rw("{max_grad_norm}"), tr("{max_grad_norm}")),
        ("ratio clip", rw("{clip_low} / {clip_high} around the proximal policy (decoupled PPO)"),
         tr("{clip[0]} / {clip[1]} ({loss_type}, {importance_sampling_level}-level)")),
        ("off-policy weight", rw("behaviour weight cap {behaviour_weight_cap} ({behaviour_weight_cap_mode}), "
                                 "eta {max_head_offpolicyness}"), tr("none (on-policy)")),
        ("loss aggregation", rw("{loss_agg}"), tr("{loss_type} (token mean over the batch)")),
        ("KL", rw("{kl_coef}"), tr("beta {beta_kl}")),
        ("advantage", rw("(r - group mean) / group std: adv_std_norm {adv_std_norm}"),
         tr("(r - group mean) / (group std + 1e-4): scale_rewards {scale_rewards}")),
        ("zero-std groups", rw("dynamic_filter {dynamic_filter}: dropped, replaced by more groups"),
         tr("kept in the batch (zero advantage)")),
        ("group size", f"{N_SAMPLES}" if c else "-", tr("{num_generations}")),
        ("batch / optimizer step", rw("{groups_per_step} groups x 8 = 64 samples, optimizer_steps {optimizer_steps}"),
         tr("{per_device_train_batch_size} completions (generation batch {generation_batch_size}), "
            "num_iterations {num_iterations}")),
        ("sampling", "T 1 (group policy), top_p 1, top_k off" if c else "-",
         tr("T {temperature}, top_p {top_p}, top_k {top_k}")),
        ("new tokens", "8 (agent max_tokens)" if c else "-", tr("{max_completion_length}")),
        ("precision", "float32" if c else "-", tr("{dtype}, bf16 {bf16}, gradient_checkpointing {gradient_checkpointing}")),
        ("processes / threads", f"trainer 1 rank + engine + gateway + runner, OMP_NUM_THREADS "
                                f"{(r or {}).get('omp_threads', '?')} each; engine batch <= {ENGINE_MAX_BATCH}, "
                                f"{GROUPS_IN_FLIGHT} groups in flight" if c else "-",
         tr("{processes} process, {torch_threads} torch threads, {generation}")),
        ("tasks", "file order, cycled" if c else "-", tr("shuffled ({shuffle_dataset})")),
        ("versions", "torch " + importlib.metadata.version("torch") if c else "-",
         tr("trl {trl}, transformers {transformers}, torch {torch}")),
    ]


def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def print_report(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    first_r = next((s["rollway"] for s in results if s.get("rollway")), None)
    first_t = next((s["trl"] for s in results if s.get("trl")), None)
    print("\nconfigurations")
    rows = config_rows(first_r, first_t)
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    print(f"  {'':<{w0}}  {'rollway':<{w1}}  TRL GRPOTrainer")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:<{w1}}  {c}")

    print(f"\nper seed (clock from the first rollout request; rolling {WINDOW_S:.0f} s mean training reward)")
    head = (f"  {'seed':>4} {'side':<7} {'order':>5} {'wall_s':>6} {'steps':>5} {'steps/s':>7} {'in/s':>6} "
            f"{'trained/s':>9} {'r_first':>7} {'r_max30':>7} {'r_end30':>7} {'t->0.3':>6} {'t->0.5':>6} "
            f"{'held-out':>13}  cpu %")
    print(head)
    for s in results:
        for side in ("rollway", "trl"):
            x = s.get(side)
            if not x:
                continue
            cpu = " ".join(f"{k} {v}" for k, v in x["cpu"].items())
            print(f"  {s['seed']:>4} {side:<7} {s['order'].index(side) + 1:>5} {x['wall_s']:>6.0f} {x['steps']:>5} "
                  f"{x['steps_per_s']:>7.3f} {x['samples_in_per_s']:>6.1f} {x['trained_per_s']:>9.1f} "
                  f"{fmt(x['reward_first3'], '.3f'):>7} {fmt(x['reward_window_max'], '.3f'):>7} "
                  f"{fmt(x['reward_window_end'], '.3f'):>7} {fmt(x['ttt_0.3'], '.0f'):>6} {fmt(x['ttt_0.5'], '.0f'):>6} "
                  f"{s['heldout_start']:>5.3f} -> {x['heldout_end']:.3f}  {cpu}")

    for s in results:
        if s.get("rollway") and s.get("trl"):
            print(f"  seed {s['seed']}: time ratio rollway / TRL "
                  + ", ".join(f"to {thr}: {fmt(s[f'ratio_ttt_{thr}'] or s[f'ratio_ttt_{thr}_bound'])}"
                              for thr in THRESHOLDS)
                  + f"; held-out end rollway {s['rollway']['heldout_end']:.3f}, TRL {s['trl']['heldout_end']:.3f}")
    for s in results:
        r, t = s.get("rollway"), s.get("trl")
        if r:
            e = r["engine"]
            print(f"\n  seed {s['seed']} rollway: trainer time per step (after the first; first at "
                  f"{fmt(r['first_step_s'])} s): " + ", ".join(f"{k} {fmt(v)}" for k, v in r["time_split"].items())
                  + "; on their own threads: " + ", ".join(f"{k} {fmt(v)}" for k, v in r["background_s"].items())
                  + f"; trainer set up in {r['trainer_start_s']} s before the clock")
            print(f"    filtered {r['filtered_frac']:.1%} of leased groups, {r['groups_stale_dropped']} dropped stale, "
                  f"staleness mean {fmt(r['staleness_mean'])} max {r['staleness_max']}, 429s {r['admission_429s']}, "
                  f"resubmits {r['resubmits']}, generated {r['generated_per_s']}/s, groups failed "
                  f"{r['groups_failed']}, trainer "
                  + ("EXITED BEFORE THE BUDGET (see trainer.log)" if r["trainer_exited_early"]
                     else "stopped at the budget"))
            print(f"    engine: paused {fmt(e['paused_pct'])}% and computing {fmt(e['busy_pct'])}% of the time, "
                  f"decode batch occupancy {fmt(e['decode_occupancy'])} of {ENGINE_MAX_BATCH} rows, prefill "
                  f"computed {e['prefill_computed_rows']} of {e['prefill_rows']} rows (identical prompts once); "
                  f"generations in flight (gateway) mean {e['in_flight_mean']}, none {e['in_flight_idle_pct']}% / "
                  f"full {e['in_flight_full_pct']}% of the time; publishes {e['publish_s_total']} s in all "
                  f"({fmt(e['publish_s_mean'])} s each, the engine paused within them)")
        if t:
            print(f"  seed {s['seed']} TRL ({t['threads']} threads; its last step ended {t['overshoot_s']} s past the "
                  f"budget and is not counted): time per step (after the first; first at {fmt(t['first_step_s'])} s): "
                  + ", ".join(f"{k} {fmt(v)}" for k, v in t["time_split"].items())
                  + f"; zero-std groups {fmt(t['zero_std_frac'], '.1%')}")

    busy = [f"seed {s['seed']} {side} {s[side]['cpu']['other']}%" for s in results for side in ("rollway", "trl")
            if s.get(side) and s[side]["cpu"].get("other", 0) > OTHER_WARN_PCT]
    if busy:
        print(f"\nWARNING: other work took more than {OTHER_WARN_PCT}% of the machine during: {', '.join(busy)}. "
              "Times are not comparable; rerun on a quiet machine.")

    if summary.get("across"):
        a = summary["across"]
        print(f"\nacross seeds {summary['seeds']} (median [min..max], n = seeds where both reached it)")
        for key, label in (("ratio_ttt_0.3", "time to 0.3, rollway / TRL"), ("ratio_ttt_0.5", "time to 0.5, rollway / TRL"),
                           ("heldout_end_rollway", "held-out end, rollway"), ("heldout_end_trl", "held-out end, TRL"),
                           ("heldout_gain_rollway", "held-out gain, rollway"), ("heldout_gain_trl", "held-out gain, TRL")):
            v = a[key]
            print(f"  {label:<28} {fmt(v['median'])} [{fmt(v['min'])}..{fmt(v['max'])}] n={v['n']}")
        for thr in THRESHOLDS:
            bounds = [f"seed {s['seed']} {s[f'ratio_ttt_{thr}_bound']}" for s in results
                      if s.get(f"ratio_ttt_{thr}_bound")]
            if bounds:
                print(f"  time to {thr}, rollway / TRL, one side only within the budget: {', '.join(bounds)}")
            for side in ("rollway", "trl"):
                v = a[f"ttt_{thr}_{side}"]
                print(f"  time to {thr}, {side:<8} {fmt(v['median'])} s [{fmt(v['min'])}..{fmt(v['max'])}] "
                      f"reached in {v['n']} of {a[f'seeds_{side}']} seeds")
        for side in ("rollway", "trl"):
            if a.get(f"cpu_{side}"):
                print(f"  CPU %, {side:<8} " + ", ".join(f"{k} {fmt(v['median'])} [{fmt(v['min'])}..{fmt(v['max'])}]"
                                                      for k, v in a[f"cpu_{side}"].items()))
