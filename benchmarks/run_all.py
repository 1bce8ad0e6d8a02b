"""Runs every benchmark on 8 simulated CPU devices; writes JSON, PNG charts and docs/benchmarks.md.

    python benchmarks/run_all.py                 # all of them (make bench)
    python benchmarks/run_all.py --only overhead,memory
    python benchmarks/run_all.py --skip-run      # charts and table from the committed JSON

Each benchmark is its own script (flags, JSON on stdout, `benchmarks/results/<name>.json`); this
driver runs them one after another (the machine's two cores are shared, so nothing runs in
parallel), then reads the JSON back, draws `benchmarks/results/<name>.png` and rewrites the
table between the `<!-- bench:start -->` and `<!-- bench:end -->` markers of docs/benchmarks.md
(the README links that page).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

#: name -> command-line flags. Order: cheap first.
BENCHMARKS = {
    "memory": [],
    "sharding": [],
    "accumulation": [],
    "compile_time": [],
    "pipeline": [],
    "pipeline_stages": [],
    "pipeline_interleaved": [],
    "pipeline_mpmd": [],
    "pipeline_schedules": [],
    "pipeline_bubble": [],
    "tp_overlap": [],
    "context": [],
    "moe": [],
    "overhead": ["--steps", "150", "--rounds", "9"],
    "overhead_log": ["--steps", "150", "--rounds", "9", "--log"],
    "overhead_accumulate": ["--steps", "150", "--rounds", "7", "--batch", "128", "--hidden", "512",
                            "--accumulate", "4"],
    # The same, Fit and the hand-written loop taking turns every 25 steps in one process.
    "overhead_accumulate_interleaved": [
        "--steps", "150", "--rounds", "7", "--batch", "128", "--hidden", "512", "--accumulate",
        "4", "--interleave", "25", "--out",
        os.path.join(RESULTS, "overhead_accumulate_interleaved.json")],
    "gan_step": [],
    "overhead_ema": ["--steps", "100", "--rounds", "5", "--ema", "0.999"],
    # The same, Fit and the hand-written loop taking turns every 25 steps in one process.
    "overhead_ema_interleaved": [
        "--steps", "100", "--rounds", "7", "--ema", "0.999", "--interleave", "25", "--out",
        os.path.join(RESULTS, "overhead_ema_interleaved.json")],
    "overhead_swa": ["--steps", "100", "--rounds", "3", "--swa", "1e-4"],
    "auto": [],
    "startup": [],
    "cli_startup": [],
    "startup_imports": ["--imports"],
    "prefetch": [],
    "gpt_input": [],
    "checkpoint": ["--devices", "1", "--strategy", "single", "--width", "1024", "--layers", "4"],
    "partial_batch": [],
    "pretrained_load": ["load"],
    "pretrained_sample": ["sample"],
    "pretrained_lora_step": ["lora-step"],
    "grpo_curve": [],
    "grpo_arithmetic_curve": [],
    "grpo_vs_tunix": [],
}


#: Entries that run another entry's script with other flags.
SCRIPTS = {"overhead_log": "overhead", "overhead_accumulate": "overhead",
           "overhead_accumulate_interleaved": "overhead",
           "overhead_ema": "overhead", "overhead_ema_interleaved": "overhead",
           "overhead_swa": "overhead", "pretrained_load": "pretrained",
           "startup_imports": "startup",
           "pretrained_sample": "pretrained", "pretrained_lora_step": "pretrained"}


def _load(name):
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _fmt(x, digits=3):
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


# -- one summary per benchmark: rows of (what, measured, target, met) --------------------------


def summarize_overhead_log(r):
    """The same, with Fit's training_step calling self.log(on_epoch=True, prog_bar=True)."""
    return [(what.replace("Fit / hand-written", "Fit with self.log(on_epoch=True) / hand-written")
             .replace("final params Fit", "final params Fit with self.log"), measured, target, met)
            for what, measured, target, met in summarize_overhead(r)]


def summarize_overhead_accumulate(r):
    """The same with accumulate_grad_batches=K against a hand-written scan over K batches."""
    k = next((res.get("accumulate_grad_batches") for res in r.get("results", [])
              if "accumulate_grad_batches" in res), "K")
    return [(what.replace("Fit / hand-written", f"Fit(accumulate_grad_batches={k}) / hand-written")
             .replace("final params Fit", f"final params Fit(accumulate_grad_batches={k})"),
             measured, target, met) for what, measured, target, met in summarize_overhead(r)]


def _in_turns(r, rows):
    """`rows` of an overhead run with --interleave N: one Fit paused every N steps for N
    hand-written steps (the median of the chunk pairs' ratios), so that a drift of the shared
    machine hits both alike."""
    n = next((res.get("interleave") for res in r.get("results", []) if "interleave" in res), "N")
    return [(what.replace("median step time", f"median step time, turns of {n} steps"), measured,
             target, met) for what, measured, target, met in rows]


def summarize_overhead_accumulate_interleaved(r):
    """`summarize_overhead_accumulate`, the loops taking turns (`_in_turns`)."""
    return _in_turns(r, summarize_overhead_accumulate(r))


def summarize_overhead_ema(r):
    """The same, with callbacks.EMAWeightAveraging(0.999) against a hand-written EMA."""
    return [(what.replace("Fit / hand-written", "Fit with EMAWeightAveraging / hand-written EMA")
             .replace("final params Fit", "final averaged params Fit"), measured, target, met)
            for what, measured, target, met in summarize_overhead(r)]


def summarize_overhead_ema_interleaved(r):
    """`summarize_overhead_ema`, the loops taking turns (`_in_turns`)."""
    return _in_turns(r, summarize_overhead_ema(r))


def summarize_overhead_swa(r):
    """The same, with callbacks.StochasticWeightAveraging(1e-4, 1, 2) against a hand-written
    SWA (SWALR's rate per epoch, the mean of the parameters at epoch starts)."""
    return [(what.replace("Fit / hand-written", "Fit with StochasticWeightAveraging / hand-written "
                          "SWA").replace("final params Fit", "final averaged params Fit"),
             measured, target, met) for what, measured, target, met in summarize_overhead(r)]


def summarize_partial_batch(r):
    p, d = r["partial"], r["padded"]
    return [("last partial batch: one more compiled step kind (s, once per fit)",
             _fmt(p["compile_train_partial_s"]), "—", None),
            ("partial step / full step time (the short batch's own shape)",
             _fmt(p["partial_step_s"] / p["full_step_s"]), "—", None),
            ("params: partial step vs padding with zero-weight rows (max abs diff)",
             f"{r['max_param_diff']:.1e}", "—", None),
            ("padded step / full step time", _fmt(d["padded_step_s"] / d["full_step_s"]),
             "—", None)]


def summarize_overhead(r):
    rows = []
    for res in r.get("results", []):
        if "error" in res:
            rows.append((f"Fit / hand-written step time, {res['devices']} dev {res['strategy']}",
                         "error", "≤ 1.02", False))
            continue
        rows.append((f"Fit / hand-written median step time, {res['devices']} device(s), "
                     f"{res['strategy']} ({res['median_hand_ms']:.2f} ms/step)",
                     _fmt(res["median_ratio"], 4), "≤ 1.02", res["ratio_met"]))
        rows.append((f"final params Fit vs hand-written, {res['devices']} device(s), "
                     f"{res['strategy']} (max rel. err.)", f"{res['final_params_max_rel_err']:.1e}",
                     "≤ 1e-6", res["params_agree_1e-6"]))
    return rows


def summarize_gan_step(r):
    """Manual optimization (two opt.step updates per step) against the same hand-written step."""
    rows = []
    for res in r.get("results", []):
        where = f"{res['devices']} device(s), {res['strategy']}"
        if "error" in res:
            rows.append((f"GAN step Fit / hand-written, {where}", "error", "≤ 1.02", False))
            continue
        rows.append((f"GAN step (2 optimizers, manual) Fit / hand-written median step time, "
                     f"{where} ({res['median_hand_ms']:.1f} ms/step)",
                     _fmt(res["median_ratio"], 4), "≤ 1.02", res["ratio_met"]))
        rows.append((f"GAN final params Fit vs hand-written, {where} (max abs. err.)",
                     f"{res['final_params_max_abs_err']:.1e}", "0",
                     res["final_params_max_abs_err"] == 0.0))
    return rows


def summarize_memory(r):
    rows = []
    for row in r["rows"]:
        rows.append((f"params + AdamW state per device, {row['strategy']}",
                     f"{row['bytes_per_param_per_device']:.2f} B/param",
                     {"dp": "12", "ddp": "12", "single": "12", "fsdp": "12/N = 1.5"}.get(
                         row["strategy"], "—"), None))
    f = r.get("fsdp_vs_dp")
    if f:
        rows.append(("FSDP state per device vs 1.05 × DP/N + replicated small",
                     f"{f['fsdp_state_bytes_per_device']:,} B",
                     f"≤ {f['bound_1.05x_dp_over_n_plus_replicated_small']:,.0f} B", f["met"]))
    return rows


def summarize_sharding(r):
    rows = [
        ("DataParallel all-reduce / 2(N−1)/N·Ψβ", _fmt(r["dp_all_reduce"]["ratio"], 4),
         "1 ± 5%", r["dp_all_reduce"]["met_within_5pct"]),
        ("FSDP all-gather + reduce-scatter / 3(N−1)/N·Ψβ", _fmt(r["fsdp"]["ratio"], 4),
         "≤ 1", r["fsdp"]["met_at_most_theory"]),
        ("FSDP(reshard_after_forward=True) on CPU / 3(N−1)/N·Ψβ",
         _fmt(r["fsdp_reshard_after_forward"]["ratio_to_theory"], 4), "(reported)", None),
        ("TP activation all-reduces per layer (b·s·h each)",
         _fmt(r["tp"]["activation_all_reduces_per_layer"]), "4", r["tp"]["met_within_5pct"]),
    ]
    return rows


def summarize_accumulation(r):
    rows = []
    for name, s in r["summary"].items():
        traffic = s["collective_traffic_bytes_by_k"]
        rows.append((f"{name}: collective bytes per step, k = {', '.join(traffic)}",
                     " / ".join(f"{v / 1e6:.2f} MB" for v in traffic.values()), "flat in k",
                     s["collective_bytes_flat"]))
        rows.append((f"{name}: temp memory, k = {', '.join(s['temp_bytes_by_k'])}",
                     " / ".join(f"{v / 1e6:.1f} MB" for v in s["temp_bytes_by_k"].values()),
                     "falls with k", s["temp_falls_with_k"]))
    return rows


def summarize_compile_time(r):
    return [(f"compile time, {row['strategy']} (train step)",
             f"{row['compile_seconds'].get('train', float('nan')):.1f} s", "—", None)
            for row in r["rows"]]


def summarize_pipeline(r):
    rows = []
    for name, run in r["equivalence"]["runs"].items():
        rows.append((f"{name} vs SingleDevice, 10 steps (max loss rel. diff)",
                     f"{run['max_loss_rel_diff']:.1e}", "≤ 1e-4", run["ok"]))
    mem = r["equivalence"]["memory"]
    rows.append(("GPipe(4) stacked-param bytes per device / (total / 4)",
                 _fmt(mem["ratio_to_total_over_stages"]), "≤ 1.05", mem["ok"]))
    c = r["collective_permute_8_devices"]
    rows.append(("collective-permute bytes vs 2(m+p−1)·b·s·h·β (rel. error)",
                 f"{c['rel_error']:.1%}", "≤ 5%", c["ok"]))
    for row in r["schedule"]["rows"]:
        rows.append((f"m = {row['microbatches']}: schedule iterations; bubble theory / measured",
                     f"{row['schedule_iterations'][0]}; {row['bubble_fraction_theory']:.2f} / "
                     f"{row['bubble_fraction_measured']:.2f}",
                     f"m+p−1 = {row['expected_iterations']}", row["iterations_ok"]))
    return rows


def summarize_pipeline_stages(r):
    rows = []
    for name, run in r["equivalence"]["runs"].items():
        rows.append((f"Stages 784→512→256→10: {name} vs SingleDevice, 10 steps "
                     "(max loss rel. diff)", f"{run['max_loss_rel_diff']:.1e}", "≤ 1e-5",
                     run["ok"]))
        mem = run["memory"]
        own = "/".join(f"{b / 1e6:.2g}" for b in mem["own_param_bytes_per_device"])
        held = "/".join(f"{b / 1e6:.2g}" for b in mem["held_param_bytes_per_device"])
        rows.append((f"Stages, {run['stages']} stages: param MB per pipeline device, own vs held "
                     "(padded to the largest stage)", f"{own} vs {held}", "held = largest",
                     mem["ok"]))
    for key, sched in r["schedule"].items():
        its = all(row["iterations_ok"] for row in sched["rows"])
        perm = all(row["permute_bytes_ok"] for row in sched["rows"])
        ms = [row["microbatches"] for row in sched["rows"]]
        rows.append((f"Stages GPipe {key}, m = {ms[0]}..{ms[-1]}: HLO iterations = m+p−1; "
                     "permute bytes = 2(m+p−1)·b·W·β", f"{'yes' if its else 'no'}; "
                     f"{'exact' if perm else 'differ'}", "all m", its and perm))
        rows.append((f"Stages GPipe {key}: bubble, max abs(measured − theory) over m (step-time "
                     f"fit; timing residual ≤ {sched.get('max_fit_rel_residual', float('nan')):.0%}"
                     f", {r.get('cpus')} CPUs)", f"{sched['max_bubble_abs_error']:.2f}", "—",
                     None))
    for name, run in r.get("balanced", {}).get("runs", {}).items():
        rows.append((f"Stages MLP, GPipe(3, 4) data 2 x pipe 3, {name}: param MB held per "
                     "device (own 1.6/0.53/0.01); argument / temp MB per device; loss rel. diff",
                     f"{run['held_param_bytes_per_device'][0] / 1e6:.2f}; "
                     f"{run['argument_bytes_per_device'] / 1e6:.2f} / "
                     f"{run['temp_bytes_per_device'] / 1e6:.2f}; "
                     f"{run['max_loss_rel_diff_vs_single']:.1e}", "≤ 1e-5",
                     run["max_loss_rel_diff_vs_single"] <= 1e-5))
    for name, lay in r.get("staged_lm", {}).get("layouts", {}).items():
        if "max_loss_rel_diff_vs_single" in lay:
            rows.append((f"{name} (embedding + head inside the pipeline), {lay['strategy']} vs "
                         "SingleDevice, 10 steps (max loss rel. diff)",
                         f"{lay['max_loss_rel_diff_vs_single']:.1e}", "≤ 1e-5", lay["ok"]))
        rows.append((f"{name} under {lay['strategy']}: permute bytes (= theory); param / temp "
                     "MB per device", f"{lay['collective_permute_bytes'] / 1e6:.2f} "
                     f"({'exact' if lay['permute_bytes_ok'] else 'differs'}); "
                     f"{lay['param_bytes_per_device'] / 1e6:.2f} / "
                     f"{lay['temp_bytes_per_device'] / 1e6:.1f}", "exact", lay["permute_bytes_ok"]))
    for name, mem in r.get("activation_memory", {}).get("layouts", {}).items():
        rows.append((f"Stages MLP, batch {r['activation_memory']['global_batch']}, {name}: "
                     "compiled temp / argument MB per device",
                     f"{mem['temp_bytes_per_device'] / 1e6:.2f} / "
                     f"{mem['argument_bytes_per_device'] / 1e6:.2f}", "—", None))
    return rows


def summarize_pipeline_mpmd(r):
    rows = []
    for name, run in r["memory"].items():
        own = "/".join(f"{b:,}" for b in run["own_param_bytes_per_stage"])
        held = "/".join(f"{b:,}" for b in run["held_param_bytes_per_device"])
        rows.append((f"{run['strategy']}, seeds' MLP in {name}: parameter bytes per device "
                     "(own / held; Adam mu, nu likewise)", f"{own} / {held}", "held = own",
                     run["bytes_ok"]))
        rows.append((f"{run['strategy']}, {name} vs SingleDevice, 10 steps (max loss rel. "
                     "diff)", f"{run['max_loss_rel_diff_vs_single']:.1e}", "≤ 1e-5",
                     run["equivalence_ok"]))
    c = r["copies"]
    rows.append((f"GPipe({c['stages']}, {c['microbatches']}, mpmd=True): boundary copies "
                 "per step = 2·m·(p−1) of b·w·β, plus the labels", f"{c['boundary_copies']}, "
                 f"{c['boundary_copy_bytes']:,} B", f"{c['expected_boundary_copies']}, "
                 f"{c['expected_boundary_copy_bytes']:,} B", c["ok"]))
    for key, sched in r["schedule"].items():
        ms = [row["microbatches"] for row in sched["rows"]]
        rows.append((f"mpmd {key}, m = {ms[0]}..{ms[-1]}: schedule read from the program "
                     "(unit-cost stages): makespan 2(m+p−1), bubble (p−1)/(m+p−1)",
                     "exact" if sched["all_schedule_ok"] else "differs", "exact",
                     sched["all_schedule_ok"]))
        last = sched["rows"][-1]
        if "step_seconds" in last:
            rows.append((f"mpmd {key}, m = {last['microbatches']}: step / serial time measured "
                         f"({r.get('cpus')} CPUs) and predicted for parallel devices",
                         f"{last['step_seconds'] / last['serial_seconds']:.2f} / "
                         f"{last['predicted_seconds'] / last['serial_seconds']:.2f}", "—", None))
    tb = r.get("timed_bubble")
    if tb:
        rows.append((f"mpmd p={tb['stages']}, equal stages, m = 1..16: bubble, max abs(measured − "
                     f"theory) from step times (fit residual ≤ {tb['max_fit_rel_residual']:.0%}, "
                     f"{r.get('cpus')} CPUs), against GPipe's precision (pipeline_stages p = 4)",
                     f"{tb['max_bubble_abs_error']:.3f}",
                     f"≤ {tb['gpipe_precision_pipeline_stages_p4']:.3f}",
                     tb["within_gpipe_precision"]))
    return rows


def summarize_pipeline_bubble(r):
    rows = []
    gpipe = r["schedules"]["gpipe"]["max_bubble_abs_error"]
    for name, run in r["schedules"].items():
        ms = [row["microbatches"] for row in run["rows"]]
        rows.append((f"mpmd {name}, p={r['stages']}, equal stages, m = {ms[0]}..{ms[-1]}: bubble, "
                     "max abs(measured − theory) from step times (fit residual ≤ "
                     f"{run['max_fit_rel_residual']:.0%}, {r.get('cpus')} CPUs), against GPipe's "
                     "in the same run", f"{run['max_bubble_abs_error']:.3f}",
                     f"≤ {max(gpipe, r['gpipe_precision_pipeline_stages_p4'] or 0):.3f}",
                     run["within_gpipe_precision_same_run"]))
    return rows


def summarize_pipeline_schedules(r):
    rows = []
    for name, run in r.get("equivalence", {}).items():
        if name == "seconds":
            continue
        parts = [v for k, v in run.items() if k != "ok"]
        worst = max(v["max_loss_rel_diff_vs_single"] for v in parts)
        param = max(v["max_param_abs_diff_vs_single"] for v in parts)
        rows.append((f"GPipe(mpmd=True, schedule={name!r}): loss vs one device (max parameter "
                     "difference), MLP and staged LM, 10 AdamW steps",
                     f"{_fmt(worst, 2)} ({_fmt(param, 3)})", "≤ 1e-5", worst <= 1e-5))
    mem = r.get("memory")
    if mem:
        act = mem["activation_bytes_per_device"]
        rows.append(("activation bytes per device, 1F1B, m = p..8p (flat) / GPipe at 8p",
                     f"{act['1f1b']['m=24']} / {act['gpipe']['m=24']}", "flat; ≤ p/m × GPipe",
                     mem["activations_flat_in_m"]["1f1b"] and mem["at_m_4p"]["ok"]))
    sched = r.get("schedule")
    if sched:
        ms = [row["microbatches"] for row in sched["1f1b p=2"]["rows"]]
        rows.append(("schedule read from the program = textbook makespan and bubble, every "
                     f"schedule, m = {ms}, p = 2..4", "all" if sched["all_ok"] else "not all",
                     "all", sched["all_ok"]))
    for name, run in (r.get("overhead") or {}).items():
        if isinstance(run, dict) and "median_ratio" in run:
            rows.append((f"Fit / hand-written {name} loop (step time, median of rounds)",
                         _fmt(run["median_ratio"], 3), "≤ 1.02", run["median_ratio"] <= 1.02))
    return rows


def summarize_pipeline_interleaved(r):
    rows = []
    for name, run in r["equivalence"]["runs"].items():
        rows.append((f"interleaved {name} vs SingleDevice, 10 steps (max loss rel. diff)",
                     f"{run['max_loss_rel_diff']:.1e}", "≤ 1e-5", run["ok"]))
    for v, res in r["schedule"]["repeats"].items():
        rows_v = res["rows"]
        its = all(row["iterations_ok"] for row in rows_v)
        perm = all(row["permute_bytes_ok"] for row in rows_v)
        bubbles = ", ".join(f"m={row['microbatches']}: {row['bubble_fraction_theory']:.2f}/"
                            f"{row['bubble_fraction_measured']:.2f}" for row in rows_v)
        rows.append((f"p=4, repeats={v}: HLO iterations v·m+p−1 and permute bytes "
                     "2(v·m+p−1)·b·h·β", f"{'yes' if its else 'no'}; "
                     f"{'exact' if perm else 'differ'}", "exact", its and perm))
        rows.append((f"p=4, repeats={v}: stack relayout permute bytes per step and device "
                     "(HLO) = 2·Δ·chunk bytes", f"{rows_v[0]['relayout_permute_bytes']:,}",
                     f"{rows_v[0]['expected_relayout_bytes']:,}",
                     all(row["relayout_bytes_ok"] for row in rows_v)))
        bound = r["schedule"].get("gpipe_precision", {}).get("bound")
        rows.append((f"p=4, repeats={v}: bubble theory/measured (step-time fit; timing "
                     f"residual ≤ {res.get('max_fit_rel_residual', float('nan')):.0%}, "
                     f"{r.get('cpus')} CPUs)", bubbles, "—", None))
        if bound is not None:
            rows.append((f"p=4, repeats={v}: bubble max abs(measured − theory) over m, against "
                         "GPipe's precision (v = 1 in this run; pipeline_stages p = 4)",
                         f"{res['max_bubble_abs_error']:.3f}", f"≤ {bound:.3f}",
                         res["within_gpipe_precision"]))
        temps = ", ".join(f"m={row['microbatches']}: {row['temp_bytes_per_device'] / 1e6:.1f}"
                          for row in rows_v)
        rows.append((f"p=4, repeats={v}: compiled temp MB per device (activations)", temps,
                     "—", None))
    return rows


def _context_memory_rows(runs, label: str, theory: str) -> list:
    """Two rows for context degrees `runs`: temporaries per device against n = 1 (target
    ~1/n) and the attention's collective bytes against `theory` (target exact)."""
    ratios = ", ".join(f"n={run['context']}: {run['temp_ratio_to_n1']:.3f}" for run in runs)
    ok = all(run["temp_ratio_to_n1"] <= 1.15 / run["context"] for run in runs
             if run["context"] > 1)
    exact = all(abs(run["attention_traffic_bytes"] - run["theory_traffic_bytes"])
                <= 1e-6 * max(run["theory_traffic_bytes"], 1) for run in runs)
    return [(f"{label}: activation (temp) bytes per device / n=1", ratios, "~1/n", ok),
            (f"{label}: attention collective bytes (HLO) = {theory}",
             "exact" if exact else "differ", "exact", exact)]


def _context_equality_rows(eq, label: str) -> list:
    return [(f"{label} {algorithm} vs SingleDevice, L={eq['length']}, {eq['steps']} steps "
             "(max abs loss diff)", f"{run['max_abs_loss_diff']:.1e}", "≤ 1e-5", run["ok"])
            for algorithm, run in eq["runs"].items()]


def summarize_moe(r):
    """Expert weights per device = total / (expert·tp·fsdp); all-to-all bytes = the buffer
    formula; dropless layer time against a dense MLP of the same active FLOPs."""
    rows = []
    for name, run in r.get("layouts", {}).items():
        ratio = run["ratio_measured_over_expected"]
        rows.append((f"MoE {name}: expert weight bytes per device / (total / expert·tp·fsdp)",
                     f"{ratio:.3f}", "1.000", abs(ratio - 1) < 1e-9))
    for name, runs in r.get("all_to_all", {}).items():
        for kind, run in runs.items():
            measured = run["per_layer_direction_bytes_measured"][-1]
            exact = measured == run["per_layer_direction_bytes_from_buffer_rows"]
            rows.append((f"MoE {name} {kind}: all-to-all bytes per layer and direction "
                         "(HLO) / ideal T·k·D·β·(n−1)/n", f"{run['measured_over_ideal']:.2f}",
                         "= n·R/(T·k) exactly", exact))
    t = r.get("step_time")
    if t:
        rows.append(("MoE dropless layer fwd+bwd / dense MLP of the same active FLOPs (CPU; "
                     "XLA:CPU's ragged_dot is a dense masked matmul)",
                     f"{t['moe_over_dense']:.2f}", "—", None))
    return rows


def summarize_context(r):
    rows = []
    for length, runs in r.get("memory", {}).items():
        for algorithm in ("ring", "allgather"):
            rows += _context_memory_rows(
                [run for run in runs.values() if run["algorithm"] == algorithm],
                f"context {algorithm}, L={length}", "4(n−1)·B·(L/n)·H·D·β per layer")
    if r.get("equality"):
        rows += _context_equality_rows(r["equality"], "context=8")
    t = r.get("time")
    if t:
        rows.append((f"context=8 step time at L={t['length']} (CPU): ring / allgather",
                     f"{t['ring_step_s'] * 1e3:.0f} / {t['allgather_step_s'] * 1e3:.0f} ms",
                     "—", None))
    pipe = r.get("pipe")
    if pipe:
        rows += _context_memory_rows(list(pipe["memory"].values()),
                                     f"pipe={pipe['pipe']} × context ring, L={pipe['length']}",
                                     "(m+p−1)·(layers/p)·4(n−1)·(B/m)·(L/n)·H·D·β")
        rows += _context_equality_rows(pipe["equality"], f"pipe={pipe['pipe']} × context=4")
    reach = r.get("reach")
    if reach:
        for algorithm, rows_n in reach["rows"].items():
            growth = ", ".join(f"n={n}: {v['max_length']} (×{v['growth']:.1f})"
                               for n, v in rows_n.items())
            top = max(int(n) for n in rows_n)
            ok = rows_n[str(top)]["growth"] >= 0.75 * top
            rows.append((f"context {algorithm}: longest sequence within "
                         f"{reach['budget_bytes'] / 2**20:.0f} MiB/device", growth, "~n×",
                         ok if algorithm == "ring" else None))
    return rows


def summarize_tp_overlap(r):
    rows = []
    for res in r["results"]:
        rows.append((f"TP({res['tp']}) overlap: dense-layer all-reduces → collective-permutes",
                     f"{res['sync']['dense_layers']['activation_all_reduces']} → "
                     f"{res['overlap']['dense_layers']['activation_all_reduces']} "
                     f"(+{res['overlap']['dense_layers']['collective_permutes']} permutes)",
                     "0 left", res["overlap"]["dense_layers"]["tp_collectives_from_matmuls"] == 0))
        ratio = res["step_time_ratio_overlap_over_sync"]
        rows.append((f"TP({res['tp']}) overlap vs sync: loss diff; step-time ratio (CPU)",
                     f"{res['max_abs_loss_diff']:.1e}; {ratio:.2f}",
                     "≤ 1e-5; (no overlap on CPU)", res["max_abs_loss_diff"] <= 1e-5))
    return rows


# -- charts ---------------------------------------------------------------------------------------


def _mib(n):
    return f"{n / 2**20:.1f} MiB"


def summarize_auto(r):
    rows = []
    for m in r["models"]:
        for run in m["runs"]:
            label = "real memory" if run["budget"] == "real" else _mib(run["usable_bytes"])
            what = (f"Fit('auto'), LM {m['size']} ({_mib(m['param_bytes'])} params), "
                    f"{label} usable per device: choice (compiles, seconds)")
            if run["chosen"] is None:
                rows.append((what, "nothing fits", f"{run['best_of_full_table']}",
                             run["found_best"]))
                continue
            ratio = run["predicted_vs_best"]
            rows.append((what,
                         f"{run['chosen']} ({run['compiles']}, {run['choose_seconds']:.1f} s)",
                         f"fits; predicted ≤ 1.05 × best of {len(m['full_table'])} "
                         f"({run['best_of_full_table']}: ×{ratio:.3f})",
                         ratio is not None and ratio <= 1.05))
    return rows


def summarize_cli_startup(r):
    m, ratio = r["median"], r["new_over_old"]
    names = {"help_s": "`jaxlight --help`",
             "recipe_first_step_s": "process start → first step, `jaxlight fit digits`",
             "target_first_step_s": "process start → first step, your module "
                                    "(new: LightningCLI's form on jsonargparse)"}
    rows = []
    for key, what in names.items():
        cpu = key.removesuffix("_s") + "_cpu_s"
        rows.append((f"CLI start-up new / old (jsonargparse vs hand-written), {what}, CPU "
                     f"seconds ({m['new'][cpu]:.2f} s / {m['old'][cpu]:.2f} s; wall "
                     f"{ratio[key]:.3f})", _fmt(ratio[cpu]), "≤ 1.05", ratio[cpu] <= 1.05))
    return rows


def summarize_startup(r):
    m = r["median"]
    load = r.get("loadavg_before")
    cpu = m["warm"].get("first_step_cpu_s")
    rows = [(f"process start → first step, `jaxlight fit digits`, warm compilation cache "
             f"(import {m['warm']['import_s']:.2f} s, init {m['warm']['init_compile_s']:.2f} s, "
             f"train compile {m['warm']['train_compile_s']:.2f} s"
             + (f"; CPU {cpu:.2f} s" if cpu is not None else "")
             + (f"; load average {load[0]:.1f} on {r.get('cpu_cores')} cores" if load else "")
             + ")",
             f"{m['warm']['first_step_s']:.2f} s", "< 2 s", r["warm_met"]),
            (f"same, cold cache (fresh directory) / cache off ({m['cold']['first_step_s']:.2f} s "
             f"/ {m['off']['first_step_s']:.2f} s)", _fmt(r["cold_over_off"]), "≤ 1 (± noise)",
             None)]
    if cpu is not None:
        rows.append((f"same in CPU seconds to the first step: cold / off "
                     f"({m['cold']['first_step_cpu_s']:.2f} s / "
                     f"{m['off']['first_step_cpu_s']:.2f} s); warm / off",
                     f"{m['cold']['first_step_cpu_s'] / m['off']['first_step_cpu_s']:.3f}; "
                     f"{cpu / m['off']['first_step_cpu_s']:.3f}", "≤ 1; < 1", None))
    return rows


def summarize_startup_imports(r):
    m, ratio, load = r["median"], r["new_over_old"], r["loadavg_median"]
    base = r["what"].split(" at ")[1].split()[0]
    where = f"old = {base}; load average {load['new']:.1f} on {r['cpu_cores']} cores"
    jax_new, jax_old = (r["import_jaxlight_loads_jax"][s] for s in ("new", "old"))
    fit_s = m["new"]["import_fit_s"]
    return [
        (f"`jaxlight --help`, process start to exit, new / old ({m['new']['help_s']:.2f} s / "
         f"{m['old']['help_s']:.2f} s; {where})", f"{m['new']['help_s']:.2f} s", "≤ 0.5 s",
         m["new"]["help_s"] <= r["targets_s"]["help_s"]),
        (f"`import jaxlight` alone, new / old ({m['new']['import_bare_s']:.3f} s / "
         f"{m['old']['import_bare_s']:.2f} s); imports JAX: new {'yes' if jax_new else 'no'}, "
         f"old {'yes' if jax_old else 'no'}", f"{m['new']['import_bare_s']:.3f} s", "no JAX",
         not jax_new),
        (f"a plain fit's imports (`jaxlight.Fit`, `TrainModule`, `callbacks`, the default "
         f"callbacks), new / old ({fit_s:.2f} s / {m['old']['import_fit_s']:.2f} s, ×"
         f"{ratio['import_fit_s']:.3f}; CPU ×{ratio['import_fit_cpu_s']:.3f}; `import jax, "
         f"flax.nnx, optax` alone {m['new']['jax_flax_optax_s']:.2f} s; {where})",
         f"{fit_s:.2f} s", "≤ 1.1 s (quiet machine)", fit_s <= r["targets_s"]["import_fit_s"]),
    ]


def summarize_prefetch(r):
    rows = []
    for pattern, m in r["median"].items():
        load = r["config"]["load_ms"]
        rows.append((f"{pattern} loader ({load:g} ms/batch, measured {m['load_ms']:.1f} ms) vs "
                     f"{m['compute_ms']:.1f} ms step: step time with prefetch "
                     f"({m['prefetch_ms']:.1f} ms) / max(load, compute)",
                     _fmt(m["prefetch_over_max"]), "≤ 1.10", m["prefetch_over_max"] <= 1.10))
        rows.append((f"{pattern} loader: step time without prefetch ({m['no_prefetch_ms']:.1f} "
                     "ms) / (load + compute)", _fmt(m["no_prefetch_over_sum"]), "≈ 1", None))
    return rows


def summarize_gpt_input(r):
    m = r["median"]
    return [(f"gpt {r['config']['preset']} tokens/s, grain with {r['config']['workers']} worker "
             f"processes / in-memory ({m['grain_workers']['tokens_per_s']:,.0f} / "
             f"{m['memory']['tokens_per_s']:,.0f}; {r['device']})",
             _fmt(m["grain_workers_over_memory"]), "≥ 0.95", r["met"]),
            ("same, grain in the training process / in-memory",
             _fmt(m["grain_over_memory"]), "—", None)]


def summarize_pretrained_load(r):
    ours, theirs = r["jaxlight"], r.get("transformers") or {}
    gib = 2**30
    yield (f"~1.24B random Llama (bf16) into FSDP over {ours['devices']} devices: peak RSS growth "
           f"/ 1.25 x (share {ours['model_bytes'] / gib:.2f} GiB + largest tensor "
           f"{ours['largest_tensor_bytes'] / gib:.2f} GiB)",
           _fmt(r["rss_growth_over_bound"]), "≤ 1", r["met_rss"])
    if theirs:
        yield (f"same, load time jaxlight / transformers from_pretrained ({ours['seconds']:.0f} s"
               f" / {theirs['seconds']:.0f} s); peak RSS {ours['peak_rss'] / gib:.2f} / "
               f"{theirs['peak_rss'] / gib:.2f} GiB",
               _fmt(r["load_time_ratio_jaxlight_over_transformers"]), "—", None)


def summarize_pretrained_sample(r):
    yield ("KV-cache sampling tokens/s, jaxlight / transformers generate (batch 8, prompt 64, "
           "128 new)", _fmt(r["tokens_per_s_ratio_jaxlight_over_transformers"]), "≥ 1", r["met"])


def summarize_pretrained_lora_step(r):
    fit_ms = sorted(x["fit_ms"] for x in r["rounds"])[len(r["rounds"]) // 2]
    yield (f"LoRA SFT step (rank {r['lora_rank']} on {'/'.join(r['targets'])}, batch "
           f"{r['batch']} x {r['tokens']}), Fit / hand-written, median of {len(r['rounds'])} "
           f"rounds ({fit_ms:.1f} ms/step; {r.get('device', 'cpu')})", _fmt(r["median_ratio"], 4),
           "≤ 1.02", r["met"])


def summarize_grpo_curve(r):
    g, d = r["grpo"], r["dpo"]
    yield ("GRPO mean sampled reward, first / last quarter of the run (tiny Qwen 3 after SFT)",
           f"{g['first_quarter_mean']:.3f} -> {g['last_quarter_mean']:.3f}", "rises",
           g["last_quarter_mean"] > g["first_quarter_mean"])
    before = g["held_out_greedy_before"]["val_reward"]
    after = g["held_out_greedy_after"]["val_reward"]
    yield ("GRPO held-out greedy reward, before -> after", f"{before:.3f} -> {after:.3f}",
           "rises", after > before)
    yield ("DPO held-out reward accuracy, before -> after",
           f"{d['reward_accuracy_before']:.2f} -> {d['reward_accuracy_after']:.2f}", "rises",
           d["reward_accuracy_after"] > d["reward_accuracy_before"])


def summarize_grpo_arithmetic_curve(r):
    yield (f"GRPO from the CLI on a JSONL of arithmetic, exact-answer reward of the sampled "
           f"batches, first / last quarter (fresh seed {r['seed']}, two reward functions)",
           f"{r['answer_reward_start']:.3f} -> {r['answer_reward_end']:.3f}", "rises", r["raised"])
    greedy = r["grpo"]["held_out_greedy"]
    before = greedy["before training"]["val_reward_exact_answer"]
    after = greedy["after training"]["val_reward_exact_answer"]
    yield (f"same, held-out greedy exact answers ({r['data']['problems']} problems, 64 held out)",
           f"{before:.3f} -> {after:.3f}", "rises", after > before)


def summarize_grpo_vs_tunix(r):
    ours, theirs = r["jaxlight"], r["tunix"]
    yield (f"GRPO generation, jaxlight rollout / Tunix Sampler + logps ({ours['generation_s']:.3f}"
           f" s / {theirs['generation_s']:.3f} s, 64 rows, CPU)",
           _fmt(r["generation_ratio_jaxlight_over_tunix"]), "≤ 1",
           r["generation_ratio_jaxlight_over_tunix"] <= 1)
    yield (f"GRPO update, jaxlight step / Tunix grpo_loss_fn + Adam ({ours['update_s']:.3f} s / "
           f"{theirs['update_s']:.3f} s)", _fmt(r["update_ratio_jaxlight_over_tunix"]), "≤ 1",
           r["update_ratio_jaxlight_over_tunix"] <= 1)


def summarize_checkpoint(r):
    a, s = r["async"], r["sync"]
    ratio = a["loop_blocked_per_save_median_s"] / s["loop_blocked_per_save_median_s"]
    every = r["config"]["every"]
    stored = "zstd" if r["config"].get("compress") else "uncompressed"
    return [(f"loop held per save, async / sync, median ({a['loop_blocked_per_save_median_s']:.4f}"
             f" s / {s['loop_blocked_per_save_median_s']:.3f} s; {r['state_megabytes']:.0f} MB "
             f"state saved every {every} steps, {stored}, verified checksums)", _fmt(ratio),
             "≤ 0.10", ratio <= 0.10),
            ("same, the previous save committed before each save (writer idle)",
             _fmt(r["async_writer_idle_over_sync_hold"]), "—", None),
            ("restore (verifying every array's checksum)", f"{r['restore_seconds']:.2f} s", "—",
             None)]


# -- accelerator results (benchmarks/gpu.sh on a GPU; not run by this driver) --------------------


def summarize_mfu(r):
    met = r["mfu"] >= r["target_mfu_1b"] if r["preset"] == "1b" else None
    rows = [(f"gpt {r['preset']} ({r['parameters'] / 1e6:,.0f}M params) MFU, {r['precision']}, "
             f"batch {r['global_batch']} x {r['seq_len']}, {r['attention']} attention, remat "
             f"{r['remat']} ({r['tokens_per_s']:,.0f} tokens/s; {r['device']}, jax {r['jax']})",
             _fmt(r["mfu"]), "≥ 0.45" if r["preset"] == "1b" else "—", met)]
    if "median_overhead_ratio" in r:
        rows.append((f"gpt {r['preset']}: Fit / hand-written median step time ("
                     f"{r['median_step_s'] * 1e3:.1f} ms/step; {r['device']})",
                     _fmt(r["median_overhead_ratio"], 4), "≤ 1.02",
                     r["median_overhead_ratio"] <= r["target_overhead"]))
    return rows


def summarize_gpu_paths(r):
    ran = [p["path"] for p in r["paths"] if p["ok"]]
    return [(f"GPU-only code paths run once ({r['device']}): " + ", ".join(ran),
             f"{len(ran)} / {len(r['paths'])} ran", "all", r["all_ok"])]


def accelerator_rows() -> list[str]:
    lines = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        name = os.path.basename(path)[:-5]
        kind = next((k for k in ("mfu", "gpu_paths", "pretrained_lora_step")
                     if name.startswith(k + "_")), None)
        report = _load(name)
        if kind is None or report is None or report.get("platform") != "gpu":
            continue
        for what, measured, target, met in globals()[f"summarize_{kind}"](report):
            lines.append(f"| {kind} | {what} | {measured} | {target} | "
                         f"{'—' if met is None else _fmt(bool(met))} |")
    return lines


def charts():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'jaxlight[plot]'): no charts")
        return
    acc = _load("accumulation")
    if acc:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for name, s in acc["summary"].items():
            ks = [int(k) for k in s["collective_traffic_bytes_by_k"]]
            a.plot(ks, [v / 1e6 for v in s["collective_traffic_bytes_by_k"].values()], "o-",
                   label=name)
            b.plot(ks, [v / 1e6 for v in s["temp_bytes_by_k"].values()], "o-", label=name)
        a.set(xlabel="microbatches k", ylabel="collective MB / step", xscale="log", title=
              "collective bytes per optimizer step")
        b.set(xlabel="microbatches k", ylabel="temp MB / device", xscale="log",
              title="temporary memory")
        a.legend(), b.legend()
        fig.tight_layout(), fig.savefig(os.path.join(RESULTS, "accumulation.png"), dpi=100)
        plt.close(fig)
    mem = _load("memory")
    if mem:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["strategy"] for r in mem["rows"]]
        params = [r["param_bytes_per_device"] / 1e6 for r in mem["rows"]]
        opt = [r["opt_state_bytes_per_device"] / 1e6 for r in mem["rows"]]
        temp = [r["memory_analysis"].get("temp", 0) / 1e6 for r in mem["rows"]]
        ax.bar(names, params, label="params")
        ax.bar(names, opt, bottom=params, label="optimizer state")
        ax.bar(names, temp, bottom=[p + o for p, o in zip(params, opt, strict=True)],
               label="temp (step)")
        ax.set(ylabel="MB per device", title="memory per device by strategy (8 devices)")
        ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, "memory.png"), dpi=100)
        plt.close(fig)
    ov = _load("overhead")
    if ov:
        fig, ax = plt.subplots(figsize=(7, 4))
        ok = [r for r in ov["results"] if "error" not in r]
        labels = [f"{r['devices']}×{r['strategy']}" for r in ok]
        ax.bar(labels, [r["median_ratio"] for r in ok])
        ax.axhline(1.02, color="r", ls="--", label="target 1.02")
        ax.set(ylabel="Fit / hand-written step time", title="framework overhead", ylim=(0.9, 1.1))
        ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, "overhead.png"),
                                                     dpi=100)
        plt.close(fig)
    ct = _load("compile_time")
    if ct:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([r["strategy"] for r in ct["rows"]],
               [r["compile_seconds"].get("train", 0) for r in ct["rows"]])
        ax.set(ylabel="seconds", title="train-step compile time (8 CPU devices)")
        fig.tight_layout(), fig.savefig(os.path.join(RESULTS, "compile_time.png"), dpi=100)
        plt.close(fig)


def table() -> str:
    lines = ["| benchmark | what | measured | target | met |", "|---|---|---|---|---|"]
    for name in BENCHMARKS:
        report = _load(name)
        if report is None:
            lines.append(f"| {name} | (not run) | | | |")
            continue
        for what, measured, target, met in globals()[f"summarize_{name}"](report):
            lines.append(f"| {name} | {what} | {measured} | {target} | "
                         f"{'—' if met is None else _fmt(bool(met))} |")
    return "\n".join(lines + accelerator_rows())


#: The page holding the table (linked from README.md and docs/index.md).
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def update_page(text: str) -> None:
    """Writes `text` between the page's markers (a new page with just a title if it is missing)."""
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    block = f"{start}\n{text}\n{end}"
    page = "# Benchmarks\n"
    if os.path.exists(PAGE):
        with open(PAGE) as f:
            page = f.read()
    if start in page and end in page:
        page = page[: page.index(start)] + block + page[page.index(end) + len(end):]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    with open(PAGE, "w") as f:
        f.write(page)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHMARKS))
    p.add_argument("--skip-run", action="store_true",
                   help="only charts and the table, from the JSON in benchmarks/results/")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per benchmark")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    status = {}
    if not args.skip_run:
        for name in names:
            script = os.path.join(HERE, f"{SCRIPTS.get(name, name)}.py")
            start = time.time()
            print(f"== {name}", flush=True)
            try:
                out = subprocess.run([sys.executable, script, *BENCHMARKS[name]],
                                     capture_output=True, text=True, timeout=args.timeout)
                status[name] = {"returncode": out.returncode,
                                "seconds": round(time.time() - start, 1)}
                if out.returncode:
                    print(out.stderr[-3000:], file=sys.stderr)
            except subprocess.TimeoutExpired:
                status[name] = {"returncode": "timeout", "seconds": args.timeout}
            print(f"   {status[name]}", flush=True)
    charts()
    text = table()
    update_page(text)
    print(text)
    print(json.dumps({"status": status}))
    if any(s["returncode"] != 0 for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
