"""Regenerates docs/performance.md (tables, target check, plots) from benchmarks/results/*.json.

    python benchmarks/report.py                       # after running the benchmarks
    python benchmarks/report.py --results DIR --doc FILE --images DIR

Needs matplotlib for the plots.
"""
import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

from _common import RESULTS_DIR, ROOT, format_table, present_columns

DOC = os.path.join(ROOT, "docs", "performance.md")
IMAGES = os.path.join(ROOT, "docs", "images")
BENCHMARKS = ("layer", "scaling", "dispatch", "dropless")  # one process each, with a machine record
MULTI_PROCESS_BENCHMARKS = ("dist_alltoall",)  # optional: needs torch.distributed.run
# optional: needs Hugging Face transformers; the second is a separate run of the 16-bit cases the
# main one skips (minutes per call for transformers' backends on CPUs without 16-bit dot products),
# the third one of the published layer shapes at decoding sizes
FRAMEWORK_BENCHMARKS = ("transformers_moe", "transformers_moe_16bit_large", "transformers_moe_full_size")
KERNEL_BENCHMARKS = ("grouped_gemm",)  # optional: one operator in isolation
# optional: experts with quantized weights (needs transformers for its bfloat16 baselines)
QUANTIZED_BENCHMARKS = ("quantized_experts", "quantized_linear")
# optional: two builds of tutel timed against each other (benchmarks/compare_builds.py)
CHANGE_BENCHMARKS = ("compare_builds", "host_cost")
# optional: runs on a GPU (benchmarks/run_on_gpu.sh), copied here from its output directory
GPU_BENCHMARKS = ("transformers_moe_cuda", "cuda_kernels", "decode_line_cuda", "quantized_experts_cuda")

# The targets (fp32, this 2-core machine).
TARGETS = {"layer/ideal E=8": 1.10, "layer/ideal E=64": 1.25, "naive/layer E=64": 5.0, "dispatch of copy": 0.5,
           "memory vs ideal": 1.2, "grouped/ideal": 1.2,
           # against transformers' experts backends and the machine's limits (every case, fp32 and bf16)
           "best_transformers/tutel": 1.2, "tutel/limit": 1.25}


def as_baseline(rows: List[dict], columns: Sequence[str]):
    """The JSON's 'ideal' (the padded-GEMM computation the layer is compared with) shown under its
    real name: it runs well below the machine's GEMM rate, so it is a baseline, not a limit."""
    def rename(key):
        return key.replace("ideal", "baseline")
    return [{rename(key): value for key, value in row.items()} for row in rows], [rename(c) for c in columns]


def with_layer_limit(rows: List[dict], gemm_gflops: Optional[float]) -> List[dict]:
    """Rows plus the compute limit of a layer step: the FLOPs of its GEMMs over the kept k*T rows
    (2 expert GEMMs and the gate GEMM, forward + 2x backward) at the machine's measured GEMM rate."""
    if not gemm_gflops:
        return rows
    out = []
    for row in rows:
        if row["dtype"] != "fp32":  # the roofline's GEMM rate is float32's
            out.append(row)
            continue
        flops = 3 * 2 * row["T"] * row["M"] * (2 * row["k"] * row["H"] + row["E"])
        limit_ms = flops / (gemm_gflops * 1e9) * 1e3
        out.append(dict(row, limit_ms=limit_ms, **{"layer/limit": row["layer_ms"] / limit_ms}))
    return out


def load_results(directory: str) -> Dict[str, dict]:
    results = {}
    for name in (BENCHMARKS + MULTI_PROCESS_BENCHMARKS + FRAMEWORK_BENCHMARKS + KERNEL_BENCHMARKS
                 + QUANTIZED_BENCHMARKS + CHANGE_BENCHMARKS + GPU_BENCHMARKS):
        path = os.path.join(directory, f"{name}.json")
        if os.path.exists(path):
            with open(path) as handle:
                results[name] = json.load(handle)
    return results


def fp32_row(rows: List[dict], shape) -> Optional[dict]:
    """The fp32 row of `shape` = (T, M, H, E, k), if measured."""
    return next((r for r in rows if r["dtype"] == "fp32" and tuple(r[key] for key in "TMHEk") == shape), None)


# ------------------------------------------------------------------------------------ targets

def target_rows(results: Dict[str, dict]) -> List[dict]:
    rows = []

    def add(target, measured, limit, at_most=True, detail="", glibc=None):
        if measured is None:
            return
        met = measured <= limit if at_most else measured >= limit
        rows.append({"target": target, "goal": f"{'<=' if at_most else '>='} {limit:g}", "measured": measured,
                     "met": "yes" if met else "no", "glibc default malloc": glibc, "where": detail})

    layer = results.get("layer", {}).get("rows", [])
    small, fine = fp32_row(layer, (4096, 512, 1024, 8, 2)), fp32_row(layer, (4096, 512, 256, 64, 2))
    if small:
        add("layer / padded-GEMM baseline", small["layer/ideal"], TARGETS["layer/ideal E=8"], detail="T=4096 M=512 H=1024 E=8 k=2",
            glibc=small.get("layer/ideal_glibc"))
    if fine:
        add("layer / padded-GEMM baseline", fine["layer/ideal"], TARGETS["layer/ideal E=64"], detail="T=4096 M=512 H=256 E=64 k=2",
            glibc=fine.get("layer/ideal_glibc"))
        add("naive / layer", fine.get("naive/layer"), TARGETS["naive/layer E=64"], at_most=False,
            detail="T=4096 M=512 H=256 E=64 k=2")
    for row in layer:
        if row["dtype"] == "fp32" and row.get("layer_mem/ideal_mem") is not None:
            add("peak memory: layer / baseline", row["layer_mem/ideal_mem"], TARGETS["memory vs ideal"],
                detail=f"T={row['T']} E={row['E']} k={row['k']}")
    for row in results.get("dispatch", {}).get("dispatch", []):
        if row["dtype"] == "fp32" and row["kernel"] != "copy":
            add(f"{row['kernel']}: GB/s / copy GB/s", row["of_copy"], TARGETS["dispatch of copy"], at_most=False,
                detail=f"T={row['T']} M={row['M']} E={row['E']} k={row['k']}")
    metadata = results.get("dispatch", {}).get("metadata")
    if metadata:
        rows.append({"target": "routing metadata O(T*k + E)", "goal": "no [T, E] tensor",
                     "measured": metadata["metadata_bytes"], "met": "yes",
                     "where": f"T={metadata['T']} E={metadata['E']}: {metadata['bytes_per_choice']:.1f} B per choice, "
                              f"dense masks {metadata['dense_over_metadata']:.0f}x larger"})
    for row in results.get("dropless", {}).get("rows", []):
        if row["routing"] == "zipf":
            add("dropless grouped / per-expert baseline (real tokens)", row["grouped/ideal"], TARGETS["grouped/ideal"],
                detail=f"T={row['T']} H={row['H']} E={row['E']}, busiest expert {row['busiest_share']:.0%}",
                glibc=row.get("grouped/ideal_glibc"))
    # the runs may come from different machines: each row keeps its run's name and CPU
    hf_rows = [dict(row, run=name, cpu=results[name].get("lscpu_model") or results[name].get("device_name"))
               for name in FRAMEWORK_BENCHMARKS for row in results.get(name, {}).get("rows", [])]

    def where(row):
        return f"worst case: {row['family']} {row['pass']} T={row['T']} ({row['run']}, {row['cpu']})"
    for dtype in sorted({row["dtype"] for row in hf_rows}, reverse=True):
        rows_of = [row for row in hf_rows if row["dtype"] == dtype]
        worst = min(rows_of, key=lambda row: row["best_transformers/tutel"])
        add(f"{dtype}: best transformers backend / tutel, every case", worst["best_transformers/tutel"],
            TARGETS["best_transformers/tutel"], at_most=False, detail=where(worst))
        for label, keep in (("T >= 2048", lambda t: t >= 2048), ("T <= 16", lambda t: t <= 16)):
            limited = [row for row in rows_of if keep(row["T"])]
            if limited:
                worst = max(limited, key=lambda row: row["tutel/limit"])
                add(f"{dtype}: tutel / machine limit, {label}", worst["tutel/limit"], TARGETS["tutel/limit"],
                    detail=where(worst))
        # moe_layer routes too: against the block's router + best backend where that pair was timed
        # (forward, up to 128 tokens), else against the experts alone (routing a negligible share)
        def against_layer(row):
            return row.get("best_block/moe_layer") or row["best_transformers/moe_layer"]
        layer_rows = [row for row in rows_of if row.get("best_transformers/moe_layer")]
        if layer_rows:
            worst = min(layer_rows, key=against_layer)
            add(f"{dtype}: transformers (block to T = 128, experts above) / moe_layer, every case",
                against_layer(worst), TARGETS["best_transformers/tutel"], at_most=False, detail=where(worst))
    return rows


# ------------------------------------------------------------------------- bytes and FLOPs

def kernel_budget(shape: dict, element_bytes: int = 4) -> List[dict]:
    """Bytes that must move and FLOPs that must happen per layer step (forward + backward),
    grouped as the profile's operators are; kept choices counted as k*T (an upper bound)."""
    T, M, H, E, k = shape["T"], shape["M"], shape["H"], shape["E"], shape["k"]
    C = k * -(-T // E)
    s, kept, slots = element_bytes, k * T, E * C
    return [
        dict(kernel="gate GEMMs (1 fwd + 2 bwd)", ops=["aten::mm"], flops=3 * 2 * T * M * E,
             bytes=3 * (T * M + E * M + T * E) * s, gemm=True),
        dict(kernel="expert GEMMs (2 fwd + 4 bwd)", ops=["aten::bmm", "aten::baddbmm"], flops=6 * 2 * slots * M * H,
             bytes=6 * (slots * M + E * H * M + slots * H) * s, gemm=True),
        dict(kernel="softmax fwd + bwd", ops=["aten::_softmax", "aten::_softmax_backward_data"], flops=8 * T * E,
             bytes=5 * T * E * s, gemm=False),
        dict(kernel="route_topk (top-k + slots)", ops=["tutel::route_topk"], flops=T * E,
             bytes=T * E * s + 12 * kept, gemm=False),
        dict(kernel="scatter_slots: encode + decode bwd", ops=["tutel::scatter_slots"], flops=3 * kept * M,
             bytes=(3 * kept * M + 2 * slots * M) * s, gemm=False),
        dict(kernel="gather_slots: decode + encode bwd", ops=["tutel::gather_slots"], flops=3 * kept * M,
             bytes=2 * (kept * M + T * M) * s, gemm=False),
        dict(kernel="bias, ReLU and their gradients", ops=["aten::copy_", "aten::relu_", "aten::clamp_min_",
                                                         "aten::threshold_backward", "aten::sum"],
             flops=slots * (2 * H + 2 * M), bytes=(slots * (2 * H + 2 * M) + 3 * slots * H + slots * (H + M)) * s,
             gemm=False),
    ]


def budget_rows(layer: dict) -> List[dict]:
    profile, roof = layer.get("profile"), layer.get("roofline")
    if not profile or not roof:
        return []
    measured = profile["ms_per_step"]
    rows, covered = [], 0.0
    for item in kernel_budget(profile["shape"]):
        ms = sum(measured.get(op, 0.0) for op in item["ops"])
        covered += ms
        if item["gemm"]:
            bound = item["flops"] / (roof["gemm_gflops"] * 1e9)
        else:
            bound = item["bytes"] / (roof["copy_gbps"] * 1e9)
        rows.append({"kernel": item["kernel"], "MB": item["bytes"] / 1e6, "MFLOP": item["flops"] / 1e6,
                     "bound_ms": bound * 1e3, "measured_ms": ms,
                     "measured/bound": ms / (bound * 1e3) if bound else None})
    rest = sum(measured.values()) - covered
    rows.append({"kernel": "everything else (small ops, autograd, Python)", "measured_ms": rest})
    return rows


# ---------------------------------------------------------------------------------- plots

def plot_scaling(scaling: dict, images: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(images, exist_ok=True)
    written = []
    for sweep, axis, label in (("tokens", "T", "tokens T"), ("experts", "E", "experts E")):
        rows = [r for r in scaling["rows"] if r["sweep"] == sweep]
        if not rows:
            continue
        figure, (times, ratio) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r[axis] for r in rows]
        for name, style in (("layer", "o-"), ("ideal", "s--"), ("naive", "^:")):
            points = [(x, r[f"{name}_ms"]) for x, r in zip(xs, rows) if r.get(f"{name}_ms") is not None]
            if points:
                times.plot(*zip(*points), style, label={"layer": "moe_layer", "ideal": "padded-GEMM baseline",
                                                       "naive": "naive one-hot einsum"}[name])
        times.set(xscale="log", yscale="log", xlabel=label, ylabel="ms per step (fwd + bwd)")
        times.legend()
        times.grid(True, which="both", alpha=0.3)
        ratio.plot(xs, [r["layer/ideal"] for r in rows], "o-")
        ratio.set(xscale="log", xlabel=label, ylabel="moe_layer / padded-GEMM baseline")
        ratio.grid(True, which="both", alpha=0.3)
        foreign = max((r.get("foreign_cpus") or 0) for r in rows)
        figure.suptitle(f"fp32, forward + backward, {scaling['machine']['torch_threads']} threads "
                        f"(other processes: at most {foreign:g} CPUs busy)")
        ratio.set_ylim(bottom=min(1.0, min(r["layer/ideal"] for r in rows)))
        figure.tight_layout()
        path = os.path.join(images, f"performance_scaling_{sweep}.png")
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    return written


def plot_transformers(result: dict, images: str) -> Optional[str]:
    """best transformers backend / tutel and tutel / limit against T (forward), one panel per dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in result["rows"] if row["pass"] == "fwd"]
    dtypes = sorted({row["dtype"] for row in rows}, reverse=True)
    if not rows:
        return None
    os.makedirs(images, exist_ok=True)
    figure, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes):
        for family in sorted({row["family"] for row in rows}):
            points = sorted((row["T"], row["best_transformers/tutel"]) for row in rows
                            if row["dtype"] == dtype and row["family"] == family)
            axis.plot(*zip(*points), "o-", label=family)
        axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="best transformers backend / tutel",
                 title=f"{dtype}, forward")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path = os.path.join(images, "performance_transformers.png")
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


# --------------------------------------------------------------------------------- document

INTRO = """# Performance

<!-- Generated by `python benchmarks/report.py` from benchmarks/results/*.json. Edit report.py, not this file. -->

Every figure below comes from the scripts in `benchmarks/`, run on the machine described here:

```
python benchmarks/layer.py && python benchmarks/scaling.py && python benchmarks/dispatch.py \\
  && python benchmarks/dropless.py && python benchmarks/report.py
```

The exchange table at the end needs several processes; run this before `report.py`:

```
PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/dist_alltoall.py
```

Each script prints its table and writes `benchmarks/results/<name>.json`; `report.py` rebuilds this
page and its plots from those files.  `--smoke` runs any script at tiny sizes with one repetition
(CI does this, so the scripts cannot rot); `--threads` sets `torch.set_num_threads` (default 2).

**How timings are taken.**  Each configuration runs in a fresh process, in which all its candidates
are timed in turn within every repetition (interleaved), and each reports its median; the
comparisons are ratios between candidates of the same run.  The machine is shared, so every
measurement records *foreign_cpus*: how many CPUs other processes kept busy meanwhile (system busy
time minus the benchmark's own CPU time, per second; 0 is a quiet machine, 2 means the two cores
were fully contended).  A step is forward plus backward with a random upstream gradient (`y.sum()`
would hand PyTorch a stride-0 gradient and favour some kernels), parameter gradients cleared to
`None` first.

**The candidates.**  *layer*: `tutel.moe.moe_layer` with the `top` gate (capacity factor 1) and
`ffn` experts (ReLU).  *baseline* (the padded-GEMM baseline; `ideal` in the JSON): the gate GEMM and
the same expert module, on tokens already laid out as `[E, C, M]`, forward and backward.  It is a
baseline, not a limit: its batched GEMMs run well below the machine's GEMM rate, so *limit* (the
step's GEMM FLOPs over the kept k*T rows at the GEMM rate measured in the same run) is given beside
it.  *naive*: a GShard /
fairseq-style layer in plain PyTorch (dense `[T, E]` one-hot masks, cumsum slots, a `[T, E, C]`
combine tensor, einsum dispatch and combine) sharing the gate and expert weights; its output is
checked against the layer's before timing (`naive_max_abs_diff` in the JSON).

**Peak memory** is the resident set's high-water mark (`/proc/self/status` `VmHWM`, reset through
`/proc/self/clear_refs`) during one step above the resident set at its start, with the step's inputs
and upstream gradients created inside the window.  It is measured in a separate process in which
glibc mmaps every large block and returns it when freed, so that the resident set follows the live
tensors.
"""


TARGETS_NOTE = """*measured* is timed with freed memory kept for reuse, as a caching allocator keeps it;
*glibc default malloc* is the same ratio under glibc's default settings (see Allocation under Notes).

"""


# Why the transformers targets that miss do, as measured (DESIGN_MEASUREMENTS holds the A/B runs).
MISSED_TARGETS_NOTE = """### Why the transformers targets that miss do, as measured

- *best transformers / tutel* (float32): in the cases below 1.2 tutel runs at or near the machine's
  limit and transformers' best backend close behind it: at T >= 2048 both run one MKL GEMM per
  expert of 256-2048 rows, the limit probe's own operation (Mixtral-like: tutel/limit about 1.0),
  and the full-size layers at T = 1 stream their weights at or above the read probe's rate
  (tutel/limit 0.7-0.9). 1.2 there would need tutel to beat the machine's GEMM rate or read
  bandwidth; nothing on this side closes it on this CPU.
- *tutel / limit, T >= 2048*: the limit is one GEMM of 4096 rows; tutel runs each expert's
  products of about 256 rows single-threaded (DeepSeek-like: 256 x 1024 x 512 and 256 x 256 x 1024),
  below the large GEMM's rate, plus the rows' gather, the gated unit and the weighted sum (10-15% of
  a call). In bfloat16 the AMX tile products and PyTorch's AMX GEMM both reach 0.5-0.8 TFLOP/s per
  thread against the unit's 2 here, waiting on memory: the packing of the matrix and token rows
  (read from L3 or memory before any tile product runs) takes about a third of a product
  ([Tile products on AMX](#tile-products-on-amx)); the weight gradient of training runs PyTorch's GEMM. The
  ratio also moves with the probe, which read 550-1500 GFLOP/s in bfloat16 across runs. What would
  close it: packing overlapped with the tile products, tile products for the weight gradient.
- *tutel / limit, T <= 16*: at one token the scaled layers read 12-90 MB of weights, 0.6-4 ms at
  the probe's rate, so fixed costs weigh: transformers' own dispatch to the experts implementation
  (about 85 us with cold caches), the call's routing and grouping, and 8-16 separate weight
  streams of 0.5-30 MB that start cold and read slower than the probe's one long stream
  (DeepSeek-like bfloat16, the worst: a cold contiguous read of the same 12.6 MB took 0.75 ms
  against the probe's 0.58). At the published layer shapes (the full-size table) the same calls
  take 0.7-1.0x the limit. What would close it: each expert's two products back to back with the
  next expert's weights prefetched, and fewer fixed costs per call.
- *transformers (block) / moe_layer*: moe_layer's SwiGLU experts keep Tutel's `[E, K, O]`
  checkpoint layout, which the tile products read more slowly than transformers' `[O, K]`
  (interleaved, 1.3-2x the `[O, K]` time at 16-64 rows), and at one token of the full-size layers
  both sides stream the weights at the read limit (ratios near 1 in float32). Single cases move
  between runs: Mixtral-like bfloat16 T = 128 read 1.04 in one full run on 2026-11-27 and 1.24 when
  run alone right after. What would close it: a faster `[K, O]` tile path at 17-64 rows.
"""


KERNEL_FORMULAS = """The work each kernel of a step cannot avoid, for T tokens of M features, E experts with hidden
size H, k choices per token, capacity C and s bytes per element (kept choices at most kT; the
expert buffer has EC slots):

| kernel | bytes that must move | FLOPs that must happen |
|---|---|---|
| gate GEMM, forward | (TM + EM + TE)·s | 2TME |
| gate GEMMs, backward (input and weight) | 2·(TM + EM + TE)·s | 4TME |
| softmax, forward / backward | 2TE·s / 3TE·s | about 4TE / 3TE |
| route_topk (top-k, slots, counts) | TE·s + 12kT + 4kE | about TE comparisons |
| encode (`scatter_slots`) | (kT·M + EC·M)·s | none (kTM with pre-scoring gates) |
| expert GEMM fc1 or fc2, forward | (ECM + EHM + ECH)·s | 2ECMH |
| expert GEMMs, backward (input and weight, both layers) | 4·(ECM + EHM + ECH)·s | 8ECMH |
| ReLU, forward / backward; biases | 2ECH·s / 3ECH·s; (ECH + ECM)·s | ECH; ECH + ECM |
| decode (`gather_slots`, gates) | (kT·M + TM)·s | 2kTM |
| decode backward (`scatter_slots` + gate dots) | (2kT·M + EC·M)·s | 3kTM |
| encode backward (`gather_slots`) | (kT·M + TM)·s | kTM |

The routing metadata is 12 bytes per choice (int32 expert, int32 slot, float32 gate) plus 4 bytes
per (choice, expert) count: O(kT + kE), never a [T, E] tensor.  Everything but the GEMMs moves
O((kT + EC)·M) bytes with at most a few FLOPs per byte, so it is bounded by memory bandwidth;
the GEMMs have 2H / s or more FLOPs per byte and are bounded by the FLOP rate.
"""


def machine_section(results: Dict[str, dict]) -> str:
    results = {name: result for name, result in results.items() if name in BENCHMARKS}
    any_result = next(iter(results.values()))
    m = any_result["machine"]
    lines = ["## Machine", "", f"* CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs), PyTorch capability "
             f"{m.get('cpu_capability', '?')}", f"* torch {m['torch']}, Python {m['python']}, {m['os']}",
             f"* torch threads: {m['torch_threads']}", ""]
    lines.append("| benchmark | finished | repetitions | most foreign CPUs during a measurement |")
    lines.append("|---|---|---|---|")
    for name, result in results.items():
        rows = [row for key in ("rows", "dispatch", "routing") for row in result.get(key, [])]
        foreign = [row["foreign_cpus"] for row in rows if row.get("foreign_cpus") is not None]
        lines.append(f"| {name} | {result['finished']} | {result.get('reps')} | {max(foreign) if foreign else ''} |")
    return "\n".join(lines)


def exchange_section(exchange: dict) -> str:
    return ("## Expert-parallel exchange (gloo, CPU)\n\n"
            f"`benchmarks/dist_alltoall.py` under `torch.distributed.run` with {exchange['world_size']} processes of "
            f"{exchange['threads']} thread(s), timing the forward exchange of an `[E, C, M]` float32 expert buffer.  "
            "*raw*: `all_to_all_single` of the same bytes into a preallocated buffer (no allocation, no "
            "re-layout: a floor, not an equivalent).  *plain*: the same exchange in plain PyTorch, "
            "`all_to_all_single` into a fresh tensor then the `[W, E/W, C, M] -> [E/W, W*C, M]` re-layout the "
            "layer needs.  *net*: `tutel.net.all_to_all(y, 1, 0)`.  *overlap4*: the overlapped layer's "
            "exchange, four chunks started in the background and then awaited (nothing to overlap with here, so "
            "this is its cost, not its gain).  Best of three interleaved medians.\n\n"
            + format_table(exchange["rows"], exchange["columns"]))


TRANSFORMERS_INTRO = """`benchmarks/transformers_moe.py` (one process, one run) times the experts module of real
transformers MoE blocks, built from configs in code with random weights (hidden size scaled to 1024:
Qwen3-MoE 64 experts top-8 I=512; Mixtral 8 experts top-2 I=3584; DeepSeek-V3 64 experts in 8 groups
top-8 I=256; gpt-oss 32 experts top-4 I=1024 with biases and its clamped interleaved gate), all
candidates on the same routing from the block's own router.  *eager*, *grouped_mm*, *batched_mm*:
transformers' experts backends (`batched_mm` only where its per-choice weight copies fit in 2 GiB).
*tutel*: tutel's experts implementation (`tutel.experts.routed_experts`).  *moe_layer*: tutel's
`moe_layer` holding the same weights (llama_ffn experts, `capacity_factor=0, megablocks_size=1`);
it runs its own top-k softmax router, so its time includes routing (not for gpt-oss, whose gate
llama_ffn cannot express).  So up to T = 128 in the forward pass, where routing is a visible share
of a call, a second interleaved pair times it against *block*: the block's own router and then the
experts under that case's best backend, in one call (*best_block/moe_layer*; DeepSeek-V3's grouped,
biased router does more than the layer's, and neither runs the shared experts).  *limit*: the
larger of the compute limit (FLOPs of the routed pairs, x3 for forward + backward, at the GEMM rate of a large `F.linear` in the same dtype) and the
bandwidth limit (bytes of the distinct experts' weights at the read bandwidth of a buffer 8x the
last-level cache), both rates measured as two more candidates interleaved with the others in every
case, so that they see the same load (*gemm_gflops*, *read_gbps*).  Every timed call, the probes' too,
starts from the same cache state: an untimed read of twice the last-level cache just before it, the
cold weights of a decoding step whatever candidate ran before.  (Without it a call paid for its
predecessor's dirty lines: after batched_mm, which writes GBs of weight copies, the next reads
waited for their write-backs; Qwen3-like T = 16, tutel 18.4 ms in such a run against 14.6 after a
read.)  Ratios above 1 in *best_transformers/tutel* mean tutel is faster.

What limits tutel here, as measured ([Routed experts on the CPU](#routed-experts-on-the-cpu) and
[Skinny products](#skinny-products) below): at a
few rows per expert (decoding, T <= 128 with top-8 of 64) the expert products are tutel's skinny
products, which stream each active expert's weights once (bf16 widened in registers) where PyTorch's
GEMMs, behind both `grouped_mm` and `eager`, pack the weights first and read them below the
machine's bandwidth (table "Grouped expert products" below); on AMD CPUs with a non-temporal
prefetch so that the streamed weights do not evict everything else the step uses (Intel's cores
keep such lines out of L2 and read at a third of the rate: Qwen3-like T = 1 6.3 ms with the hint
on an Intel Xeon, 2.5 without, so it is not given there).  The skinny products have an AVX2 and
an AVX-512 build: with AVX-512 (register blocks of 4 x 4 for `[O, K]` weights, strips with the sums
in registers for `[K, O]`, bf16 on AVX512-BF16's dot products) they keep up with PyTorch's AVX-512
GEMM to 32 rows per expert in float32 and, beside AMX, to 3 (`[O, K]`) and 6 (`[K, O]`) in
bfloat16; the AVX2 build hands over at 9 and 5 rows on such a CPU.  Past that line, bfloat16 groups run tutel's AMX tile products
where the CPU has AMX (to 256 rows of `[O, K]` weights, 64 of `[K, O]`): PyTorch's AMX GEMM
repacks each expert's whole matrix for every product, while the tile products take `[O, K]`
weights as they lie in memory (from 128 rows each work item packs its 64 matrix rows once, so
that the sums come out as token rows), read `[K, O]` ones of up to 16 token rows in place too (the token
rows spread over alternate lanes to match the matrix's own pairs: 8 experts of [1024, 7168] at
9-16 rows 4.4-4.6 ms against 7.7-7.8 interleaved) and interleave larger ones as they stream
([Tile products on AMX](#tile-products-on-amx)); bf16 T = 128 in A/B calls, tiles against none: Qwen3-like 19.7 against 32.8 ms,
gpt-oss-like 24.1 against 30.4, DeepSeek-like 9.3 against 13.0.  Measured on an Intel Xeon in A/B runs of this benchmark (two
each, tutel ms before -> after): float32 T = 128 Qwen3-like 39.5 -> 27.5 and 40.6 -> 35.3,
DeepSeek-like 25.0 -> 14.5 and 29.2 -> 16.5, gpt-oss-like (`[K, O]`) 40.7 -> 29.3 and 43.1 ->
31.9, moe_layer on Qwen3-like (`[K, O]`) 46.4 -> 27.3 and 47.1 -> 27.3; bfloat16 T = 16
Qwen3-like 13.5 -> 6.9 and 11.5 -> 7.2, DeepSeek-like 5.3 -> 3.7 and 6.7 -> 3.9.  Up to 4096 grouped rows the whole
call of gated experts is one operator (`tutel::routed_gated_experts`: grouping, the rows' copy, both
products, the unit, the weighted sum), called without the dispatcher and, from transformers, with
the module's layout cached; what remains at T = 1 besides the weights' streaming is about 0.2 ms
of fixed costs with the caches cold after the weights streamed through them: transformers' own
dispatch to the experts implementation (about 85 us), the shortcut's checks and the operator's work
around the products ([Routed experts on the CPU](#routed-experts-on-the-cpu); the whole call at smoke sizes
0.45-0.58 ms before those changes, 0.20-0.26 after).  Those fixed costs are what keeps the scaled
layers' T = 1 above 1.25x their bandwidth limit (DeepSeek-like: 25 MB of weights, 0.86-0.95 ms at
the read probe's rate in float32); at the published layer shapes (the full-size table below) the
same call took 0.8-1.25x of it (below 1 where the prefetched streams read faster than the probe's
plain sum). `moe_layer` in inference runs the same operator (llama_ffn's SwiGLU experts, gate and up as
two matrices) and adds its routing and auxiliary loss, about 20 small operations at T = 1: timed
inside one Qwen3-like call after a 256 MiB read (Zen 3, before the one-call operator), routing
0.76 ms (gate 0.12, top-k 0.12, GShard loss 0.16, capacity and checks the rest). Where nothing is
differentiated those now run as one C++ pass after the gate and the softmax
([moe_layer inference on the CPU](#moe_layer-inference-on-the-cpu); cold one-token calls on the Xeon, interleaved: Qwen3-like bf16
3.13 -> 2.29 ms, DeepSeek-like 2.12 -> 1.48). At T >=
2048 both sides run PyTorch's GEMM per expert (tutel's bf16 groups of up to 256 / 64 rows its AMX
tile products), which takes 80-90% of either side's time. tutel runs
each expert's product single-threaded, the threads claiming the products one at a time as they
finish the last, largest first: one 128-512-row GEMM split over both threads ran at 94-158 GFLOP/s
where two single-threaded ones ran at 2 x 84-91 (the grouped operator at T = 2048: Qwen3-like down
projection 182 -> 131 ms, DeepSeek-like 100 -> 78 ms), and claiming instead of lists fixed from
the products' multiply-adds shares the products whose GEMM runs slower than its estimate (bf16
weight gradients 1.45x the input gradient's time): Mixtral-like bf16 forward+backward at T = 2048
447 -> 282 ms, forward 119 -> 85 ms, Qwen3-like fp32 forward+backward 1175 -> 922 ms
([Large groups](#large-groups-work-balance)). Its operators' large buffers come from a block cache
(`tutel.ops.host_buffers`): under glibc's default malloc every block over 32 MiB is a fresh mapping
faulted in page by page, which cost a Qwen3-like training step at T = 2048 213 000 page faults and
about 0.45 s of system time (1.31 -> 1.0 s without them); transformers' backends still pay them
here (grouped_mm: 360 000 faults per step; with glibc told to keep freed memory for the whole
process, `MALLOC_MMAP_MAX_=0` and a large `MALLOC_TRIM_THRESHOLD_`, its step fell from 1.5-1.7 to
1.25-1.3 s, tutel's from 1.31 to 0.97 s, before the cache). Around the GEMMs tutel saves one fused
gate+up product, the gated unit in one pass forward and one backward where PyTorch's composition
makes 5 to 12 (also for moe_layer's separate gate and up products), the biases inside the products
and routing in one counting pass; in inference the rows go through the experts in pieces of about
64 MiB gathered from the tokens and added back, so no buffer spans all T*k rows. With native bf16
dot products (AMX) the 16-bit GEMMs run in bf16; on a CPU without them tutel runs 16-bit GEMMs
in float32 once experts average 32 rows, which transformers' backends do not; the widened weights
go into reused buffers (`tutel::to_dtype`): into fresh tensors the conversion's page faults cost
more than the conversion (Mixtral-like experts at T = 128: 188.7 -> 86.0 ms per call). The bf16 compute limit
uses the bf16 GEMM rate, as defined; where that rate is far below float32's (no native bf16), a bf16
*tutel/limit* below 1 means tutel beat the dtype's own GEMM."""


GROUPED_GEMM_INTRO = """`benchmarks/grouped_gemm.py` times the experts' grouped product alone: one gate+up projection of
64 experts of [1024, 1024] (F.linear layout), r rows per expert (8 active experts below 8 rows, as
when decoding one token with top-8, all 64 from 8 rows on).  *tutel*: `torch.ops.tutel.grouped_linear`
(skinny products up to 32 rows, up to 3 in bfloat16 beside AMX and AMX tile products from there to 256; PyTorch's
GEMM per expert above); *grouped_mm*:
`torch.nn.functional.grouped_mm`; *per_expert_linear*: one `F.linear` per expert, as transformers'
eager experts do.  *limit*: the larger of the FLOPs at the GEMM rate of a large `F.linear` in the dtype
and the active weights' bytes at the read bandwidth, both measured as interleaved candidates."""


CPU_GEMM_LINES = """## CPU GEMM size lines

Which product runs each group of an experts' grouped product on the CPU: tutel's skinny products, its
AMX tile products, or PyTorch's GEMM (`csrc/gemm/policy.h` holds the lines; docs/design.md, "The CPU
GEMM", says why each product wins where it does).  Below, the measurements behind each line, by the
machine that took them: 2 threads, the candidates' calls on the same groups one after the other in
one process, each product after a read of a large buffer (the cold caches of a decoding step).  To
compare a whole call against PyTorch's GEMM alone, run it with `TUTEL_CPU_GEMM=torch`, which sends
every expert product to `at::mm` / `at::addmm`, one group after another.

### AMD EPYC, Zen 1-3 (AVX2; PyTorch's GEMM on the same 256-bit units)

* `kSkinnyMaxRows` = 32: below it PyTorch's GEMM, packing the matrix for every product, was slower
  at every shape measured (fp32, 64 experts of [1024, 1024]: 53 ms skinny against 79-85 at 16 rows,
  91 against 108-116 at 32; at 64 rows the packing pays off); the "Grouped expert products" table
  above shows the same on the Xeon.
* `kSkinnyRowsOfAnyLength` = 20 and `kSkinnyMaxRowBytes` = 160 KiB (float32 `[O, K]`, AVX2): past
  20 rows the token rows, read again for every pair of matrix rows, fall out of L2 when long, while
  the GEMM packs the matrix once.  Zen 3, 8 experts, each product after a 64 MB read, GB/s of matrix
  read, skinny / GEMM: `[4096, 14336]` (Mixtral-8x7B's down projection) at 3 / 4 / 8 / 12 / 16 / 20 /
  24 rows 21 / 26 / 17 / 12 / 9.4 / 7.1 / 5.8 against 8.8 / 10 / 9.3 / 7.9 / 7.5 / 7.1 / 6.6;
  `[4096, 7168]` at 4 / 8 / 16 rows 27 / 18 / 7.9 against 11 / 11 / 7.6; `[1024, 3584]` at 16 / 20 /
  24 / 32 rows 10.6 / 8.3 / 6.5 / 4.3 against 8.8 / 6.9 / 7.2 / 5.7; `[1024, 2048]` at 16 / 24 / 32
  rows 8.2 / 6.6 / 5.3 against 7.5 / 7.3 / 6.4.  (A byte bound alone sent Mixtral-8x7B's down
  projection to the GEMM from 3 rows: 312 ms per experts call at 16 tokens against a bandwidth
  limit of 178.)

### Intel Xeon (AVX-512, AVX512-BF16, AMX)

8 active experts, each product after a 600 MB read, ms.

* `kSkinnyMaxRowsBesideWideFma` = 8 (float32) and `kSkinnyMaxRowsBesideBf16Dot` = 4 (bfloat16): the
  AVX2 skinny products beside a GEMM on full-width 512-bit FMA and native bfloat16 dot products,
  both layouts; skinny / GEMM: float32 `[O, K]` 1024 x 1024 at 8 / 12 / 16 rows 1.49 / 2.36 / 3.07
  against 2.09 / 2.80 / 2.74, 1024 x 512 0.93 / 1.42 / 2.57 against 1.02 / 1.31 / 1.52, 7168 x 1024
  at 8 / 12 rows 12.2 / 30.0 against 21.3 / 27.5; `[K, O]` 1024 x 512 at 8 rows 1.27 against 0.97;
  bfloat16 `[O, K]` 7168 x 1024 at 4 / 6 / 8 rows 9.0 / 13.4 / 12.4 against 8.7 / 10.9 / 7.9, 1024 x
  3584 3.1 / 5.2 / 6.8 against 3.6 / 3.8 / 3.7.  At 1-2 rows the skinny products took 0.3-0.7x the
  GEMM's time.  (With 32 rows there, a Mixtral-like bf16 experts call at 128 tokens took 54 ms, with
  8 about 21; grouped_mm 27.)
* `kSkinnyMaxRows` = 32 for the AVX-512 skinny products in float32 (both layouts, any row length),
  `kWideSkinnyMaxRowsBesideBf16Dot` = 6 and `kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs` = 8 in
  bfloat16 without AMX tiles: they run on the same units as the GEMM.  AVX-512 skinny / GEMM, ranges
  of two runs: float32 `[O, K]` 1024 x 1024 at 16 / 24 / 32 rows 2.50-2.75 / 3.08-3.51 / 3.88-4.70
  against 3.16-4.07 / 3.62-3.76 / 4.38-4.96, 1024 x 3584 at 8 / 16 / 24 / 32 rows 5.4-6.2 / 7.4-9.6 /
  9.6-13.1 / 12.1-16.0 against 12.6-15.0 / 10.7-11.3 / 12.1-12.8 / 14.8-15.4; `[K, O]` 1024 x 1024 at
  16 / 24 / 32 rows 2.90-2.94 / 3.60-3.80 / 4.69-4.98 against 3.55-3.93 / 4.16-4.17 / 4.60-4.85, 3584
  x 1024 8.1-8.6 / 8.3-10.4 / 11.4-13.8 against 11.9-12.2 / 13.2-14.2 / 16.1-16.6; bfloat16 `[O, K]`
  1024 x 1024 at 6 / 8 / 12 rows 1.02-1.33 / 1.24-1.46 / 1.69-2.00 against 1.93-2.18 / 1.65-1.90 /
  1.76-1.93, 1024 x 3584 at 6 / 8 rows 4.13-4.14 / 4.24-4.88 against 3.22-4.31 / 3.16-4.37; `[K, O]`
  1024 x 2048 at 8 / 12 / 16 rows 3.35-3.42 / 4.05-4.87 / 5.29-6.30 against 3.82-4.25 / 4.01-4.30 /
  4.23-4.63.
* `kWideSkinnyMaxRowsBesideTiles` = 3 (bfloat16 `[O, K]` beside AMX): the tile products take over
  from 4 rows; calls interleaved, skinny / tiles at 4 / 5 / 6 rows: `[7168, 1024]` 6.74 / 7.67 /
  8.27 against 6.73 / 6.74 / 7.07, `[1024, 3584]` 4.23 / 4.28 / 4.82 against 3.23 / 2.98 / 3.06,
  `[4096, 14336]` 41.1 / 65.1 / 72.7 against 35.2 / 44.8 / 42.9, `[2048, 768]` 1.63 / 1.76 / 2.27
  against 1.52 / 1.75 / 1.83, `[1024, 1024]` 1.15 / 1.32 / 1.34 against 1.20 / 1.26 / 1.25, `[512,
  1024]` 0.71 / 0.78 / 0.75 against 0.78 / 0.72 / 0.68; at 1-3 rows each won on some shapes (3 rows:
  `[7168, 1024]` 6.29 against 7.18, `[1024, 3584]` 3.13 against 2.49).
* `kWideSkinnyMaxRowsBesideTilesInnerByOutputs` = 6 (bfloat16 `[K, O]` beside AMX, which the tiles
  read in place up to 16 rows): skinny / tiles at 6 / 7 / 8 rows: 8 experts of `[3584, 1024]` 3.2 /
  4.1 / 5.4 against 2.9 / 3.2 / 4.3, `[1024, 3584]` 2.5 / 3.7 / 4.0 against 2.8 / 3.4 / 3.1; 64
  experts of `[512, 1024]` 3.6 / 4.3 / 4.5 against 3.5 / 3.4 / 3.3, `[1024, 256]` 2.5 / 3.5 / 3.1
  against 2.5 / 4.1 / 3.1.
* `kTileMaxRows` = 256 (`[O, K]`) and `kTileMaxRowsInnerByOutputs` = 64 (`[K, O]`): past them
  PyTorch's bfloat16 GEMM, which repacks the matrix for every product, catches up.  Calls
  interleaved, tiles / GEMM: `[O, K]` 1024 x 1024 at 8 / 16 / 64 / 256 rows 1.25 / 1.19 / 2.30 /
  7.05 against 2.26 / 2.27 / 3.36 / 7.18 (in separate runs 512 and 2048 rows took 14.2-21.4 and
  60.5-83.1 against 13.3-15.1 and 49.0-59.4: loading the tiles' matrix rows, a whole matrix row
  apart, costs more than the GEMM's repacking there); `[K, O]` 2048 x 1024 at 9 / 16 / 32 / 64 / 96 /
  128 / 192 rows 4.21 / 4.76 / 5.85 / 7.96 / 10.4 / 13.4 / 19.2 against 6.74 / 6.38 / 7.40 / 9.42 /
  10.6 / 13.0 / 16.0 (the sums of larger groups pass through memory between chunks of matrix
  rows).  At 1-6 rows of `[O, K]` the skinny products and the tiles ran alike (1.12-1.40 against
  0.98-1.32 ms).
* `kMinPieceExtent` = 128: a large group's GEMM is cut into pieces for the threads (by rows, or by
  features for a weight gradient), never shorter than this, where packing the other operand again
  costs more than the balance wins."""


DESIGN_MEASUREMENTS = """## Measurements behind the design

docs/design.md says how each part of the code works and why; the figures behind its decisions are
here, under the part of the code each one justifies.  They come from two machines: a shared 2-core
AMD EPYC (Zen 3 unless Zen 1 is named; AVX2, no AVX-512) and an Intel Xeon with AVX-512, AVX512-BF16
and AMX, 2 threads.  An item names its machine where it was recorded with the figures.
Candidates ran interleaved in one process while other jobs ran, so only the ratios carry over;
*a -> b* is before -> after a change, in ms unless named; "after a 256 MB read" means each call was
timed after reading a large buffer, the cold caches of a decoding step.

### Routed experts on the CPU

`tutel.experts.routed_experts` and the operators it calls.

* **The plan** (`tutel::group_by_expert`): at T = 1 the dozen small tensor operations around a
  comparison sort took 0.37 ms, a tenth of a decoding step; the counting pass takes 0.06 ms.
* **Wrappers.**  Each autograd Function or custom-operator dispatch cost 20-100 microseconds on the
  AMD EPYC, and a decoding step makes a dozen.  After a 256 MB read one `torch.empty(4)` cost about
  40 us and one operator through `torch.ops` about 50 us, where warm they cost 5 and 3.
* **The gated unit in one pass** (`gated_unit`), [16384, 1024] units, 2 threads, Zen 3, forward and
  backward: SwiGLU 201 -> 85 ms, gpt-oss' unit 634 -> 87 ms.  Composed from PyTorch operators the
  elementwise chain had been a fifth of a gpt-oss training step at 2048 tokens.
* **Biases inside the products.**  Added after the product (an `index_select` of [N, O] bias rows, a
  `where` keeping the dropped rows' gradient out of the last expert, an add, and their zero-filled
  buffers in the backward) they took another tenth of a gpt-oss training step.
* **Size of the inference pieces.**  Pieces of 8 MiB / 512 rows (which had kept the intermediates
  below glibc's 32 MiB mmap threshold before the block cache) left a few dozen rows per expert for
  each GEMM: 1.0-1.2x slower than the 64 MiB / 4096-row pieces at T = 2048..8192 (fp32, four
  families).  Gathering a piece's token rows into a fresh 128 MB tensor cost 83 ms of page faults
  against 13 ms of copying, hence `select_rows` into a cached buffer.
* **Gated experts in one operator call** (`tutel::routed_gated_experts`).  The six operator calls
  and the Python between them cost 0.15-0.25 ms at one token with the caches cold.  One token, fp32,
  each call after a 256 MB read, both paths interleaved: DeepSeek-like 1.06 -> 0.84 ms, Qwen3-like
  1.73 -> 1.50, Mixtral-like 2.42 -> 2.18, gpt-oss-like 1.55 -> 1.34; at 16 tokens 0.95-0.99x the
  time.  moe_layer's `llama_ffn` experts on the same operator, a whole call at one token with its
  routing: 0.86-0.92x (Qwen3-, Mixtral-, DeepSeek-like, fp32 and bf16), at 16 tokens 0.94-0.98x.
* **Cold fixed costs at one token.**  At smoke sizes (no weights to speak of) a whole one-token call
  of a transformers experts module took 0.45-0.58 ms cold (the four families' smoke shapes), against
  a DeepSeek-like layer's 0.8-1 ms of weight streaming.  Three changes took it to 0.20-0.26 ms, and
  the one-token call at the benchmark's shapes (fp32, each call after a 256 MB read, old and new
  builds in alternating processes, two runs each) from 1.21-1.30 to 1.02-1.09 ms (Qwen3-like),
  1.43-1.64 to 1.21-1.24 (DeepSeek-like), 1.16-1.28 to 1.10 (gpt-oss-like) and 1.03-1.05 to 0.96-1.01
  (Mixtral-like):
  - the work around the products out of ATen's operators (the grouping into plain arrays, the rows
    scattered and gathered by `core/dispatch.h`, the routing weights converted in a loop): the
    operator's own cold time 130 -> 40 us (DeepSeek-like experts had spent 90 us of the 130 in
    those operators);
  - `tutel._C.routed_gated_experts` bound directly, past the dispatcher: cold, 100 -> 50 us per call;
  - transformers' integration reading a module's layout once and caching it.

  What is left at one token is transformers' own dispatch to the experts implementation (about 85 us
  cold, the same for every backend), the shortcut's checks (about 50 us) and the bound call (about
  70 us with the operator's work), plus the weights' streaming, which the skinny products run at
  the read probe's rate (1.0-1.07x on one product over 16-88 MB; smaller reads pay their start).

### moe_layer inference on the CPU

* **On the routed experts' pieces.**  Time of transformers' fastest backend over moe_layer's
  (Qwen3-like block, fp32, benchmark runs before and after, together with the non-temporal prefetch
  of the skinny products): T = 1 1.05 -> 1.18, T = 2048 0.96 -> 1.10, T = 8192 0.92 -> 1.06.  At
  T = 1 about 25 small operations remained (routing, loss, plan), each costing 20-40 microseconds
  right after the weights streamed through the caches.
* **The router's 16-bit product** (`tutel.ops.linear.token_linear`).  PyTorch's bf16 / fp16 CPU
  linear costs tens of microseconds per call whatever the size: bf16 [1, 1024] x [64, 1024]^T 52 us
  warm, x [256, 7168]^T 252 us, against 14 and 70 us on tutel's grouped operator.  float32 stays with
  `F.linear`, whose BLAS GEMV is faster there, and so do batches past 16 rows (PyTorch's GEMM catches
  up from 64-128 rows).  A whole cold moe_layer call at one token (bf16, each call after a 600 MB
  read, interleaved): DeepSeek-like 2.35 -> 2.21 ms, Qwen3-like 3.29 -> 3.03, together with
  `_compute_dtype` reading the experts' own parameters before walking the module tree.
* **Two calls** (the `layer_in_two_calls` path, `tutel.ops.direct.route_without_grad`).  Building
  Tutel's crit tuple, normalizing the
  gates, the GShard loss and the capacity in a dozen small operators, then turning the lists back
  into [k, T] tables, took 0.6 of the 1.9 ms of a cold one-token DeepSeek-like bfloat16 call.  Cold
  calls on the Intel Xeon, interleaved with the general forward: one token, bfloat16, Qwen3-like
  3.13 -> 2.29 ms, Mixtral-like 3.79 -> 3.15, DeepSeek-like 2.12 -> 1.48; float32 4.19 -> 3.36,
  4.30 -> 3.86, 3.09 -> 2.30; at 16 tokens 0.4-1.0 ms less.  bfloat16 results are bitwise the general
  forward's, float32 ones within an ulp.
* **`gated_unit_pair`** (SiLU(gate) * up and both gradients in one pass, in place of PyTorch's silu,
  mul and their backward with four [N, I] temporaries): a Qwen3-like moe_layer training step at
  T = 2048 went from 1.14-1.34 s to 0.98-1.02 s, together with the block cache.  A fused gate / up
  GEMM inside `llama_ffn` was not measured: its checkpoint layout keeps the two matrices apart, so
  one GEMM would copy them every call; at T = 1 the separate products read the same bytes, and at
  large T reading the rows twice is a small share of the GEMMs' time.

### Expert products on the CPU: dtype and operator

Interleaved candidates, best of 5-8 rounds, on the shared 2-core AMD EPYC (Zen 3, AVX2, no AVX-512).

* **16-bit GEMMs in float32 on CPUs without 16-bit dot products** (`tutel.ops.precision.gemm_dtype`).
  oneDNN reports no native bf16 on this CPU, and PyTorch's bf16 grouped_mm ran 2.5x (2 threads) to
  3.9x (1 thread) slower than converting rows and weights to float32, multiplying in float32 and
  rounding back (256 rows per expert, 16 experts, H = U = 1024: 1928 against 779 ms and 2242 against
  579 ms).  With few rows per expert the conversion of the weights dominates and native bf16 wins
  (16 rows: 564 ms against about 670), hence the line at 32 rows per expert.  A whole Qwen3-MoE
  experts module (`benchmarks/transformers_moe.py --families qwen3_moe --tokens 1,16,2048`, bf16,
  T = 2048, candidates interleaved): transformers' `grouped_mm` backend 4960 ms, tutel 764 ms,
  `moe_layer` 883 ms.
* **No separate decode path.**  A per-expert Python loop gathering each active expert's tokens (no
  sort, no grouped buffer) was not faster than the grouped path at small T (fp32, Qwen3-MoE shape,
  1 thread: T = 1 11.9 against 13.2 ms, T = 16 128 against 122 ms; bf16 T = 1 9.3 against 4.3 ms):
  the grouped operator skips empty groups, so the grouped path already reads only the active
  experts' weights.  Not kept; what decoding needed was a faster product for a few rows (the skinny
  products).
* **`grouped_mm` against tutel's grouped operator.**  With PyTorch's GEMM inside both they ran alike
  from 64 rows per expert on (2 threads, 64 experts of [1024, 1024], fp32: 175 against 175 ms at 64
  rows, 646 against 645 ms at 256); below that the skinny products win, so `expert_linear` and
  `grouped_rows_mm` run tutel's operator on the CPU and `grouped_mm` on CUDA.
* **The custom operator's dispatch.**  Going through `torch.library.custom_op` costs about a tenth of
  a millisecond, as much as decoding's product for a small expert, so outside tracing and autograd
  `grouped_rows_mm` calls its implementation directly.

### Routed experts on CUDA

Qwen3-30B-A3B's layer, bfloat16, on the H200 of "On a GPU" below (`benchmarks/profile_experts.py`).

* `torch.nn.functional.grouped_mm` (CUTLASS on sm90), the same kernel as transformers' `grouped_mm`
  backend, took the same time on both sides.
* Zeroing the result rows past the last group, a masked pass over the whole [N, O] result twice per
  forward and twice more in the backward, took 0.16 of 0.98 ms of GPU time per forward call at
  T = 2048; routed experts no longer zero them.
* The gated unit as separate SiLU and product kernels took 0.07 ms at T = 2048, and with the plan as
  a dozen tensor operations a call at T = 1 made 35 kernel launches against 21 for transformers'
  `grouped_mm` path (0.86 against 0.50 ms).  The fused kernels make 7 launches per forward call at
  any T, 8 with gpt-oss' biases (which had been three launches per projection, 14 in all): counted
  on fake CUDA tensors, not yet timed on a GPU.
* The decode kernel's line is measured by `benchmarks/decode_line.py` (its table comes under "On a
  GPU" below once a GPU run is recorded) and written to `tutel/ops/decode_lines.json` by its
  `--apply`; without a line for the device the kernel takes every call within its tested sizes.

### Quantized experts at decoding sizes on the CPU

`tutel.experts.routed_quantized_experts` (and transformers' FP8 experts through "tutel") with up to
32 tokens run `tutel::decode_quantized_experts`, which reads each chosen expert's packed codes once;
more tokens dequantize each busy expert's matrices once for all its rows.
`benchmarks/quantized_experts.py` times the call in the three formats against bfloat16 and the
floor of reading the chosen experts' bytes once, at gpt-oss-20b's and Qwen3-30B-A3B's layer
shapes, on both sides of the line.  The line is the operator's range (what it is made and tested
for), not a measured crossover; the script's figures are under "Quantized experts on the CPU" below.

### Routing on the CPU

* `core::select_topk` skips blocks of 16 scores that cannot enter the top-k list only from 256
  experts on (`kScanMinExperts`): with few experts most blocks pass and the test is extra work
  (15% slower at 64 experts, 1.7x faster at 1024).

### Large groups: work balance

* **One GEMM after another**, each split over the threads (every thread packing its share of the
  same panels, the threads synchronising inside): at the 64-512 rows an expert gets in a layer's
  batch the split cost a tenth to a third of the rate (the single-threaded GEMMs' figures below).
* **Claiming against fixed lists** (the transformers experts call, interleaved A/B on the Intel
  Xeon).  Lists fixed in advance from the estimates (longest-processing-time, within 4/3 of the best
  spread had the estimates been the times) left one thread every weight gradient of a backward,
  whose GEMM (a transposed left operand) took 1.45x the input gradient's time in bfloat16, and spread
  the forward's equal products by estimate while their rates varied.  Claiming as threads finish:
  bfloat16 forward+backward at T = 2048 Mixtral-like 447 -> 282 ms, Qwen3-like 414 -> 329,
  DeepSeek-like 244 -> 222; float32 Qwen3-like forward+backward 1175 -> 922; forward bfloat16
  Mixtral-like T = 2048 / 8192 119 -> 85 / 674 -> 544, float32 Qwen3-like 306 -> 293 / 1092 -> 1044.
* **Cutting large products** at half of one thread's share: cut at a quarter with 64-row pieces,
  Mixtral-like T = 8192 ran 1.3x slower (the other operand packed more often).
* **Single-threaded GEMMs against one GEMM at a time** (AMD EPYC, Zen 3, fp32, one call of the
  grouped operator at T = 2048 with random top-k routing, one-by-one -> spread): Qwen3-like gate+up
  (64 experts of [1024, 1024]) 255 -> 224 ms, its down projection ([1024, 512]) 182 -> 131 ms (94 ->
  132 GFLOP/s), DeepSeek-like down ([1024, 256]) 100 -> 78 ms, Mixtral-like up (8 experts of
  [2816, 1024]) 187 -> 164 ms.  A GEMM's single-threaded rate hardly depends on the rows (84-91
  GFLOP/s from 128 to 4096 rows), the two-threaded one does (149 at 128 rows, 158 at 256, 180 at
  4096).
* **The skinny and tile products' items claimed largest first** instead of `parallel_for`'s equal
  halves of the item range (the transformers experts call on the Intel Xeon, A/B, ms): bf16 T = 128
  Qwen3-like 19.1 -> 16.2, Mixtral-like 16.3 -> 14.6, DeepSeek-like 9.8-11.8 either way; bf16
  T = 16 Qwen3-like 11.3 -> 10.5, gpt-oss-like 9.9 -> 9.1; float32 Mixtral-like T = 1 / 16 4.8 ->
  4.6 / 17.9 -> 17.1; T = 1 otherwise equal within the noise.  Skinny items in runs of neighbours
  (`WorkQueue::claim_run`) against single claims, which had the threads take turns along the same
  matrix: bf16 Qwen3-like experts at one token 1.96 against 2.06 ms.

### Reused CPU buffers

* **Without the cache.**  A Qwen3-like training step at 2048 tokens through the transformers
  integration took 213 000 minor faults (850 MB: dispatched rows, products, gated units, their
  gradients, 384 MB of weight gradients) and 430-530 ms of system time against 1.9 s of user time
  (2-core Zen 3).  With glibc told to keep everything for the whole process (`MALLOC_MMAP_MAX_=0`,
  a huge `MALLOC_TRIM_THRESHOLD_`) the step went from 1.31 s to 0.97 s, transformers' `grouped_mm`
  backend from 1.7 s to 1.25-1.3 s.
* **With the block cache** (`tutel.ops.host_buffers`): the same step, 0 faults, 1.31 -> 1.0 s.
* **Conversions into it.**  Widening Mixtral-like bf16 experts to float32 (`tutel::to_dtype`) took
  130 ms into fresh tensors and 18 ms into kept ones (2-core Zen 3); a routed_experts call at
  T = 128 went from 188.7 to 86.0 ms.  A fresh [N, H] buffer for `choice_rows` (the grouped rows'
  copy) costs 3-4x the copy itself in page faults.

### Skinny products

* **PyTorch's GEMM at a few rows** (`benchmarks/grouped_gemm.py`, AMD EPYC, Zen 1, AVX2): a one-row
  product of a [1024, 1024] fp32 matrix read it at about 11 GB/s, 8 rows at 4 GB/s, against
  20-22 GB/s for a plain sum over a large buffer; bf16 GEMMs ran at 10 GFLOP/s (no native bf16 dot
  products) against 65 for fp32.
* **`[K, O]` as one long stream.**  Walking the matrix in chunks of 32 rows x 256-output strips
  (1 KiB runs at the row stride) was 1.1-1.9x slower at 1 to 32 token rows (fp32 and bf16, 1024 x
  1024 and 1024 x 7168, Zen 1): the prefetchers follow one long stream, not 32 short ones.  2 or 1
  matrix rows per pass instead of 4 were 1.04-1.4x slower at 1-4 token rows.
* **Two accumulators per sum** with a single token or matrix row: against one, bf16 at 2-3 token
  rows 0.80-0.83x the time, float32 unchanged.
* **Long `[O, K]` rows, 2 x 4 blocks** (`kFourMatrixRowsInL1`, 16 KiB for four rows): Zen 3, 2
  threads, float32, 8 experts, each product after a 256 MB read, two runs each: K = 3584 (Mixtral's
  down projection) at 4 / 5 / 8 rows per expert 3.7-3.9 -> 3.4-3.5, 5.0-5.2 -> 4.7, 6.7-7.0 -> 5.8 ms;
  K = 2048 at 4 / 8 rows 4.5-4.7 -> 4.1, 7.7-9.4 -> 6.8-6.9 ms; 6-7 rows within 3% either way.  Rows
  of exactly a page at 4 token rows: K = 1024 with 7168 outputs (Mixtral's gate and up) 7.7 -> 6.7
  ms, bfloat16 K = 2048 2.74 -> 2.38 ms, at 8-16 rows unchanged.  At 3 rows the old order stayed
  faster (3.6-3.7 against 4.2 ms), so the blocks start at 4.
* **Short `[O, K]` rows one by one** (rows under a 4 KiB page): Zen 3, 2 threads, 8 experts, each
  product after a 256 MB read: float32 K = 256 at 1 / 4 / 8 / 32 token rows 0.48 -> 0.30, 0.51 ->
  0.39, 0.91 -> 0.67, 2.79 -> 2.48 ms (a plain sum of the same bytes 0.27 ms); K = 512 at 1 / 8 rows
  0.40 -> 0.31, 0.89 -> 0.69 ms; bfloat16 K = 512 / 1024 at 1 row 0.40 -> 0.30 / 0.72 -> 0.53 ms;
  float32 K = 1024 (a whole page) and longer rows unchanged or slower.  16-bit token rows widened
  again for every matrix row: bfloat16 K = 512 at 8 / 16 / 32 rows 1.22-1.25x slower, at 1 / 2 / 4
  rows 0.74 / 0.88 / 0.86x, hence one by one only up to 4 rows (`kFewRowsOf16Bit`); with the 1 x 4
  blocks still 1.05-1.34x slower at 5-32 rows (bfloat16 and float16, K = 512 and 1024).  The 1 x 4
  blocks themselves, against token pairs (8 experts [1024, K] after a 256 MB read): bfloat16 at 4
  token rows K = 512 / 1024 0.70 -> 0.46 / 1.38 -> 0.71 ms; float32 gained at 4-8 rows with K = 512
  (0.87-0.96x) but lost at 16-32 rows with K = 256 (1.12-1.14x), so it keeps the pairs.
* **Prefetching 8 matrix rows ahead** (`kPrefetchRowsAhead`), Zen 1, one token row, 8 of 64 experts:
  `[O, K]` bfloat16 13 -> 17 GB/s, float32 with 512-element rows 15 -> 16 GB/s; `[K, O]` bfloat16
  12 -> 16 GB/s (4 token rows: 7.7 -> 9.8), float32 unchanged.  Prefetching 1 KiB ahead in the same
  row gained less (about 10% for `[O, K]` bfloat16).
* **At most 32 KiB ahead** (`kPrefetchBytesAhead`, for `[O, K]` rows over 4 KiB): Zen 3, 2 threads,
  8 experts, each product after a 64 MB read, GB/s of matrix read, 8 rows ahead -> the bound: float32
  [4096, 14336] (Mixtral-8x7B's down projection, one row ahead) at 1 / 2 / 4 token rows 32.5 / 34.4 /
  30.2 -> 36.5 / 39.1 / 32.5; [28672, 4096] (its gate and up, two rows) 28.9 / 36.9 / 33.7 -> 30.0 /
  39.4 / 35.2; [1024, 3584] 24.5 / 24.5 / 20.4 -> 26.8 / 23.0 / 23.5; bfloat16 [1024, 3584] (four
  rows) 25.2 / 23.9 / 23.8 -> 26.4 / 25.1 / 25.0; rows of up to 4 KiB unchanged.  Mixtral-8x7B's
  experts call: float32 at one token 0.92-0.94x the time, at 16 tokens 0.98x; bf16 at one token 0.96x.
* **The non-temporal hint** (`kNonTemporalWindowDot`, `kNonTemporalWindowStream`), Zen 1 (32 KiB
  L1D): one token, one MoE block through transformers' tutel backend, DeepSeek-like 2.45 -> 2.02 ms,
  Qwen3-like 3.44 -> 3.24 ms; the products alone 0.89-0.97x at 1-2 rows, equal at 4-32.  Beyond the
  windows the lines arrived too early and were evicted before use (1.1-1.2x slower).  On the Intel
  Xeon (8 experts, one token row, each product after a 600 MB read, GB/s of matrix read, hint -> T0;
  a plain read of the same bytes 33-46): float32 `[O, K]` 1024 x 1024 8.4-9.1 -> 36-40, `[K, O]`
  tiles 256 and 512 outputs wide 10.7-11.2 -> 21.6 and 7.4-10.1 -> 32.9; no prefetch at all 30-36.
  One token through a Qwen3-like block's tutel backend took 6.3 ms with the hint, 2.5 ms with T0
  (`grouped_mm` 4.1), so the hint is given on AMD CPUs only.
* **AVX-512 against AVX2 and PyTorch's GEMM** (Intel Xeon, 8 active experts after a 600 MB read):
  fp32 `[O, K]` [1024, 1024] at 16 rows 2.5-2.8 ms against AVX2's 4.1-5.7 and PyTorch's 3.2-4.1;
  [1024, 3584] at 8 / 16 rows 5.4-6.2 / 7.4-9.6 against the GEMM's 12.6-15.0 / 10.7-11.3; bf16
  [1024, 1024] at 8 / 16 rows 1.2-1.5 / 2.1-2.3 ms against AVX2's 1.6 / 2.9; fp32 `[K, O]`
  [1024, 2048] at 6 / 8 / 16 rows 2.8-2.9 / 3.4-3.6 / 5.2-5.3 ms against AVX2's 4.6-6.2 / 5.3-5.6 /
  9.1-11.1 and the GEMM's 5.9-6.1 / 5.8-6.2 / 6.9-7.1.  One 32-output strip down all of k (a new
  page at every matrix row) was 1.2-1.6x slower than the AVX2 kernel at 8-32 token rows.
* **AVX-512 `[O, K]` blocks sharing the prefetches** of the data further on, against the first
  block asking for all (Intel Xeon, 8 experts after a 600 MB read, medians of four runs): float32
  [1024, 1024] at 16 / 32 token rows 2.9 -> 2.7 / 5.0 -> 4.6 ms, bfloat16 at 6 rows 1.40 -> 1.33
  ms; float32 [1024, 3584] at 16 rows 9.6-10.1 -> 7.2-9.2 ms (three runs).
* **AVX-512 `[K, O]` strips from 3 token rows** (`kStreamRows` = 2; Intel Xeon, 8 experts
  [1024, 2048] after a 600 MB read, ms strips / AVX2 stream in two or three runs): float32 at 1 / 4 /
  6 / 8 / 16 token rows 2.41-2.70 / 2.60-2.91 / 2.79-2.92 / 3.45-3.61 / 5.25-5.34 against
  2.40-3.11 / 2.83-3.31 / 4.59-6.19 / 5.30-5.59 / 9.09-11.1 (PyTorch's GEMM from 8 rows 5.82-6.20 /
  6.88-7.09); bfloat16 at 1 / 4 / 8 rows 1.55-1.80 / 1.80-2.07 / 3.35-3.42 against 1.48-1.53 /
  2.55-2.68 / 5.13-5.43.
* **bf16 widened in registers** (a shift for the even values, a mask for the odd ones): zero-extending
  two 8-value halves instead cost twice the vector work and capped bf16 at the fp32 kernel's element
  rate on Zen 1, half its bandwidth.

### Tile products on AMX

Intel Xeon with AMX, 2 threads, calls interleaved in one process.

* **Why tiles.**  PyTorch's bfloat16 GEMM (oneDNN's AMX kernels) repacks the whole matrix on every
  call; at the 8-256 rows an expert gets in a batch of 16-2048 tokens a bfloat16 group past the
  skinny products' line ran at 5-7 GB/s of matrix read, where the skinny products reach 13-18.
* **`[O, K]` packed from 128 token rows** (`kMatrixPackedMinRows`).  In place, at 256 inner values,
  timed apart by leaving parts out, the write-out took 1.9-2.0 ms of a 3.1 ms product, the 16 x 16
  transposition 0.9-1.0 of it.  8 experts, ms packed / in place: [1024, 256] at 128 / 192 / 256 rows
  0.80 / 1.61 / 2.14 against 0.81 / 1.82 / 2.48, [1024, 512] 2.02 / 2.71 / 3.76 against 2.03 / 2.90 /
  4.03; [512, 1024] 1.63 / 2.97 / 3.38 against 1.49 / 2.83 / 3.30 (within the noise at 1024 inner
  values); whole DeepSeek-like and Qwen3-like bf16 experts calls at 2048 tokens within the noise
  (36.5 / 36.8 and 60.9 / 60.4 ms in one run).  Wider packed items (128-256 outputs) helped at 1024
  rows (12.5-14.3 against 15.0-15.6 ms single-threaded, [512, 1024]), where the GEMM still runs.
  The bfloat16 stores rounding in one 512-bit pass (`avx512::store16`) took the in-place write-out
  at 256 inner values from 2.7-3.8 to 2.0 ms (single thread, [1024, 256], 8 experts of 256 rows).
* **`[K, O]` read in place up to 16 token rows** (`kInPlaceMaxRows`), each call after a 600 MB read,
  ms in place / interleaved: 8 experts of [1024, 7168] at 9 / 12 / 16 rows 4.4 / 4.6 / 4.4 against
  7.7 / 7.8 / 7.7 (the `[O, K]` layout of the same bytes: 4.2 / 4.3 / 4.3), [3584, 1024] 2.9 / 3.0 /
  3.9 against 3.9 / 4.0 / 4.4, 64 experts of [512, 1024] 3.8 / 3.4 / 3.7 against 5.6 / 4.5 / 4.7,
  [1024, 256] 2.4 / 2.4 / 2.6 against 2.5 / 2.6 / 2.7; with a second token block (20-24 rows) the
  tiles come from the cache again through twice the tile products and interleaving caught up (5.3
  against 3.6-3.9 for [1024, 256], 7.8 against 6.6 for [1024, 3584]).  Against the skinny products
  from 7 rows (6 / 7 / 8 rows, [3584, 1024]: 2.9 / 3.2 / 4.3 against 3.2 / 4.1 / 5.4 ms).
* **Steps per chunk in place** (`kInPlaceChunkSteps` = 4), 8 experts of [1024, 7168] / [3584, 1024]
  at 16 token rows, ms: 1 step (sums through memory every step) 4.8 / 4.8, 4 steps 4.9 / 3.9, 8 steps
  8.6 / 3.3 (64 rows read side by side stream, 128 outrun the prefetchers), against 8.0 / 5.3
  interleaving and 4.4 / 2.3 for the same matrices as `[O, K]`.  Walking 32-column strips down all
  of k instead of chunks took 7.2 against 4.4 ms (16 rows).
* **Work items of `[K, O]` products** (`kMaxInterleavedItemOutputs` = 1024): 8 experts of
  Mixtral-like [1024, 3584] at 64 rows, 11.6 ms with items 3584 wide (one step per chunk), 9.5 with
  1024 (the GEMM 9.4); at 16 / 32 rows 4.0 / 6.2 against 4.2 / 5.6.  In place, whole rows stream
  best: [1024, 7168] at 16 rows 4.9 ms with items 7168 wide, 6.0 with 1024.  Interleaving 32-column
  strips down all of k read the matrix at 5-7 GB/s (a new page every matrix row).
* **Where the lines are** (`kTileMaxRows`, `kTileMaxRowsInnerByOutputs` and the skinny lines beside
  the tiles: "CPU GEMM size lines" above).  Below the skinny line `[O, K]` 1024 x 1024 ran alike
  either way, but longer and wider matrices read faster on the tiles from 4 rows (the AVX-512 skinny
  products streaming at 11-15 GB/s there against 20-21).  Whole experts calls, tiles against none:
  bfloat16 T = 128 Qwen3-like 19.7 against 32.8 ms, gpt-oss-like 24.1 against 30.4, DeepSeek-like 9.3
  against 13.0; T = 2048 forward Qwen3-like 132 against 141, gpt-oss-like equal; T = 16 and training
  at T = 2048 within the noise.
* **What would go further.**  The AMX unit multiplies at about 2 TFLOP/s per core here (a loop of
  tile products on tiles in L1: 1.9-2.0; with one operand streaming from L2 1.76, both 1.37); the
  packed products reach 0.5-0.8 of that per thread and PyTorch's GEMM about the same.  With every
  tile load served from L1 (the operands' addresses pinned) the packed products at [512, 1024], 256
  rows ran only 10-30% faster, and a profile of that run put 17% in packing the matrix and 14% in
  copying the token rows (both read from L3 or memory, 4-8 MB per call): the products wait on memory
  before they wait on the tiles.  Tried and measured slower or equal: writing each block pair's rows
  while the next pair's tile products run (2.43-2.67 against 1.93-2.17 ms, [1024, 256], single
  thread); token rows as A tiles straight from the operand, without the copy (2.66 against 2.09,
  5.04 against 3.54 for [512, 1024]); `[K, O]` matrices packed the same way against interleaving and
  the GEMM at 32-512 rows (within 10% of each other both ways); k-blocking the packed loop (8 or 16
  steps per chunk: within the noise).  Before the packed products, a k-blocked loop for large groups
  (a chunk of matrix rows packed so its A tiles come from L1, the sums carried in scratch) ran at
  about 1 TFLOP/s on two cores with all operands in L1 against the GEMM's 0.6; inside the operator
  (8 steps per chunk) it gained at 512 rows (8.3 against 12.4 ms, 1024 x 1024, 8 experts) but lost
  at 64-256 (2.96 / 4.84 / 6.77 against 2.40 / 4.28 / 6.45), where the copy is not repaid.  What is
  left is overlapping the packing with the tile products.
* **Interleaved `[K, O]` is the slower layout:** at 16-64 rows it takes 1.3-2x the `[O, K]` time for
  the same bytes (Mixtral-like [1024, 7168], 8 experts, 16 rows: 8.4-10 against 4.9-5.8 ms).  Timed
  apart, the interleaving of matrix rows into B tiles streams at 14-16 GB/s where a plain read of the
  same matrix runs at 20-21, and the tile loop, whose sums go through memory every 4 steps, takes
  2 / 5 / 4.5-10 ms at 16 / 32 / 64 rows on its own.  Prefetching two row pairs ahead gained 15-20%
  in a standalone copy of the interleaving loop, 0-5% in the operator; unpacking instead of
  `VPERMT2W` 2-3% more; wider or narrower items and more steps per chunk nothing beyond the noise.
  Reading in place closed the gap up to 16 rows; past that it keeps moe_layer's `llama_ffn` experts
  (Tutel's `[K, O]` checkpoint layout) behind transformers' layout in bfloat16 (Mixtral-like
  T = 128, 23-44 rows per expert)."""


def gemm_rates(limits: Dict[str, float], unit: str = "GFLOP/s", scale: float = 1.0) -> str:
    """'float32 GEMM 183 GFLOP/s, bfloat16 GEMM 21 GFLOP/s' from a run's measured limits."""
    return ", ".join(f"{key.replace('gemm_gflops_', '')} GEMM {value / scale:.0f} {unit}"
                     for key, value in limits.items() if key.startswith("gemm_gflops_"))


def grouped_gemm_section(result: dict) -> str:
    m = result["machine"]
    return ("## Grouped expert products\n\n" + GROUPED_GEMM_INTRO + "\n\n"
            f"Measured on: {m['cpu']} ({m['logical_cpus']} logical CPUs, {m['torch_threads']} threads); torch "
            f"{m['torch']}; finished {result['finished']}.\n\n" + format_table(result["rows"], result["columns"]))


def compare_builds_section(result: dict) -> str:
    """The last before/after run of benchmarks/compare_builds.py."""
    m, revisions = result["machine"], result["revisions"]
    rows = [{"case": r["case"], "candidate": r["candidate"], "before_ms": r["before_ms"], "after_ms": r["after_ms"],
             "after/before": r["after/before"], "spread before": r["before_spread"], "spread after": r["after_spread"]}
            for r in result["rows"]]
    return ("## Before and after a change (`benchmarks/compare_builds.py`)\n\n"
            f"tutel built at {revisions['before']} (before) and at {revisions['after']} (after), each in its own "
            f"processes taking turns (before, after, after, before, ...: {result['rounds']} processes per build, "
            f"{result['reps']} interleaved calls per candidate in each, every call on cold caches).  *tutel*: the "
            "transformers experts module under `experts_implementation=\"tutel\"`; *moe_layer*: tutel's layer "
            "with the same weights, its router included.  A time is the median over a build's processes; "
            "*spread* is (slowest - fastest) / median of those processes, the noise to read *after/before* "
            f"against.  Measured on: {m['cpu']} ({m['logical_cpus']} logical CPUs, {m['torch_threads']} threads); "
            f"torch {m['torch']}; finished {result.get('finished', '?')}.\n\n"
            + format_table(rows, ["case", "candidate", "before_ms", "after_ms", "after/before", "spread before",
                                  "spread after"]))


def host_cost_section(result: dict) -> str:
    """The Python calls and the time of one warm call at tiny sizes (benchmarks/host_cost.py)."""
    return ("## Host cost per call\n\n"
            f"`{result['command']}` (finished {result['finished']}, torch {result['torch']}, {result['threads']} "
            f"thread(s), {result['reps']} interleaved rounds; Tutel 0.3.3: {result['reference']}).  `package calls`: "
            "Python calls inside the candidate's own package files per warm forward (cProfile; tutel's, or Tutel "
            "0.3.3's for it), the count tests/python/test_host_cost.py holds; `shape fns`: of those, tutel's shape "
            "functions, which run on fake tensors only (a GPU runs kernels there); on fake CUDA only the counts mean "
            "anything.  Sizes: 256 features, 128 per expert, 32 experts, bfloat16; the tiny eval row: 16 features, 4 "
            "experts, fp32, one thread.  Targets: transformers experts <= 30 calls on CUDA at any T, moe_layer <= 60, "
            "the experts call no slower than batched_mm's, the tiny moe_layer forward <= 0.6x Tutel 0.3.3's.\n\n"
            + format_table(result["rows"], result["columns"]))


def quantized_experts_section(result: dict) -> str:
    """Experts with quantized weights against bfloat16 on the CPU (benchmarks/quantized_experts.py)."""
    m = result["machine"]
    columns = ["model", "T", "experts_read", "bf16_ms", "bf16/limit", "hf_eager_ms", "hf_grouped_mm_ms"] + \
        [column for f in ("mxfp4", "nvfp4", "fp8_block") for column in (f"{f}_ms", f"{f}/limit", f"bf16/{f}")] + \
        ["mxfp4/read", "bf16/mxfp4_read", "fp8_block/read", "bf16/fp8_block_read", "bf16_threads", "mxfp4_threads",
         "read_gbps"]
    columns = present_columns(result["rows"], columns)
    targets = [{"model": t["model"], "T": t["T"], "target": t["target"], "value": t["value"],
                "met": "yes" if t["met"] else "**no**"} for t in result["targets"]]
    return ("## Quantized experts on the CPU (`benchmarks/quantized_experts.py`)\n\n"
            "The layers of gpt-oss-20b (H = I = 2880, 32 experts, top-4, clamped SwiGLU with biases) and "
            "Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8) with bfloat16 activations: "
            "`tutel.experts.routed_quantized_experts` on MXFP4, NVFP4 and block-FP8 (128 x 128) weights "
            "(weight-only), `routed_experts` on the same layer in bfloat16 (*bf16*), and transformers' own "
            "experts in bfloat16 (*hf_eager*, *hf_grouped_mm*).  *limit*: the bytes of the distinct experts the "
            "tokens chose, in each candidate's format, over the read bandwidth measured in the same run; "
            "*bf16/X*: how many times faster X is than tutel's bfloat16 call.  At T <= 16 the run also times a sum "
            "over as many bytes as the call's chosen experts hold (*X/read*: X's time over that read's; "
            "*bf16/X_read*: bf16's time over it, the most a call reading X's bytes once could gain over "
            "bf16 here; *X_threads*: X's time on one thread over its time on all, near 1 for a call that waits "
            "on memory, near the thread count for one held back by its instructions).  Every timed call starts "
            "on cold "
            f"caches.  Measured on: {m['cpu']} ({m['logical_cpus']} logical CPUs, {m['torch_threads']} threads); "
            f"torch {m['torch']}; finished {result.get('finished', '?')}.\n\n"
            + format_table(result["rows"], columns) + "\n\nTargets:\n\n"
            + format_table(targets, ["model", "T", "target", "value", "met"]))


def quantized_linear_section(result: dict) -> str:
    """tutel::quantized_grouped_linear against the bfloat16 grouped product (benchmarks/quantized_linear.py)."""
    m = result["machine"]
    experts, outputs, inner = result["shape"]
    return ("### The quantized grouped product (`benchmarks/quantized_linear.py`)\n\n"
            f"One stack of {experts} experts of {outputs} x {inner} weights times bfloat16 rows grouped by expert: "
            "`tutel.ops.quantized_linear.quantized_grouped_linear` in each format against tutel's bfloat16 grouped "
            "product (`grouped_rows_mm`) on the same weights dequantized to bfloat16.  Measured on: "
            f"{m['cpu']} ({m['logical_cpus']} logical CPUs); torch {m['torch']}; finished "
            f"{result.get('finished', '?')}.\n\n" + format_table(result["rows"], result["columns"]))


def transformers_section(result: dict, picture: str = "") -> str:
    m, limits = result["machine"], result["limits"]
    rates = gemm_rates(limits)
    flags = result.get("cpu_flags")
    foreign = max((row.get("foreign_cpus") or 0) for row in result["rows"]) if result["rows"] else 0
    warning = ""
    if foreign > 0.5:
        warning = (f"**Other processes kept up to {foreign:g} of the {m['logical_cpus']} CPUs busy during this run**: "
                   "single measurements swing by 2x and more, so ratios between neighbouring cells are not reliable "
                   "and the table says little about the targets; re-run the command on a quiet machine.\n\n")
        if "gemm_gflops" not in result["columns"]:
            warning += ("This run predates the interleaved limit probes: its limits use the rates measured once "
                        "before the cases, so *tutel/limit* can fall below 1 where the load eased later.\n\n")
    return ("## Against transformers' experts backends\n\n" + TRANSFORMERS_INTRO + "\n\n"
            f"Measured on: {result.get('lscpu_model') or m['cpu']} ({m['logical_cpus']} logical CPUs, "
            f"{m['torch_threads']} threads{', flags: ' + flags if flags else ''}); torch {m['torch']}; "
            f"finished {result['finished']}.  Rates before the cases: {rates}, read {limits['read_gbps']:.1f} GB/s.  "
            f"tutel ran as the experts implementation `{result.get('tutel_backend')}`.  Command: "
            f"`{result.get('command', 'python benchmarks/transformers_moe.py')}`.\n\n"
            + warning + picture + format_table(result["rows"], result["columns"]))


GPU_INTRO = """`bash benchmarks/run_on_gpu.sh DIR` builds tutel with its CUDA operators, runs the tests that need a
GPU and the GPU benchmarks below, and writes their JSON to DIR (copied to benchmarks/results).
`benchmarks/transformers_moe.py --device cuda --full-size` times the same candidates as above on the
published models' own layer shapes (Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8; Mixtral-8x7B:
H 4096, I 14336, 8 experts, top-2; DeepSeek-V3: H 7168, I 2048, 256 experts in 8 groups, top-8, one
shared expert; gpt-oss-20b: H 2880, I 2880, 32 experts, top-4), in bfloat16, every timed call ended
by a synchronisation (the time a caller waits, kernel launches included; no CUDA graphs).  The
limits are measured the same way on the GPU: an 8192-cube bf16 product and a read of 1 GiB or 8x the
L2 cache, whichever is larger.  *tutel_vs_eager*: the relative difference of tutel's output from the
eager backend's, both in bf16.

What the run showed: both sides run the same CUTLASS grouped GEMM (`torch.nn.functional.grouped_mm`;
at T = 2048, Qwen3-like, 2.79 against 2.78 ms of kernel time over five calls in `torch.profiler`,
`benchmarks/profile_experts.py`), so the differences are what surrounds it.  Forward, tutel ran at
0.30-1.03x transformers' best backend: at T = 1 the call is launch-bound (Qwen3-like: 35 kernel
launches per call against 21 for grouped_mm; 0.86 ms against 0.50 ms, and 0.26 ms for batched_mm), and at
T = 2048 tutel spent 0.98 ms of GPU time per call against 0.89 ms, of which 0.16 ms went to zeroing
the rows past the last group of each grouped product over the whole [N, O] result, and 0.07 ms more
to a separate SiLU and product where no fused gated kernel exists on CUDA.  Training at T = 2048 was
1.2x faster than grouped_mm for Qwen3 and 1.03x for DeepSeek-V3 (0.95x Mixtral, 0.96x gpt-oss).  Since
that run the routed experts no longer zero those rows (`grouped_rows_mm(zero_tail=False)`: nothing
reads them), and the CUDA path was rebuilt around fused kernels: the plan (`group_by_expert`), the
gated unit, the grouped copy (`choice_rows`) and the biases (`add_expert_bias_`, the up bias inside
the gated unit) are NVRTC kernels, a forward call is 7 kernels at any T, 8 with gpt-oss' biases (2
for inference up to 32 tokens, `decode_experts`), the dtypes `grouped_mm` has no kernel for
(float32, float16) take tutel's grouped products (`grouped_rows_linear`) instead of one product per
expert, and `moe_layer` on one process takes a path with no host synchronisation
(docs/cuda-backend.md, "The paths a CUDA graph captures"); counted on fake CUDA tensors, not yet
timed on a GPU: the table above is the run before those changes.

Runs since the CUDA graph fields were added show a second table per run: *<name>_kernels*, the
kernels one call launches (torch.profiler's events on the device after warm-up; memcpy and memset
not counted); *<name>_graph_ms*, the time per call replayed from a captured CUDA graph (CUDA events,
interleaved rounds like the times above), empty where the capture failed (the errors are listed
under the table); *best_transformers_graph/tutel_graph*, transformers' fastest replayed backend over
tutel's replay; *tutel_sync_free* and *moe_layer_sync_free*, whether a training and a decoding step
ran under `torch.cuda.set_sync_debug_mode("error")`; *moe_layer_graph_equal*, whether moe_layer's
replayed output equals its eager output (bit for bit, or within one bf16 rounding unit)."""

GRAPH_ERROR_FIELDS = ("_graph_error", "_sync_error", "_kernels_error")


def cuda_failures(rows: List[dict]) -> List[str]:
    """One line per (candidate, kind of failure, error) among the rows' <name>_graph_error,
    <name>_sync_error and <name>_kernels_error fields, with the cases it happened in: a backend that
    cannot be captured usually fails the same way in every case."""
    cases: Dict[tuple, List[str]] = {}
    for row in rows:
        for key, value in row.items():
            suffix = next((s for s in GRAPH_ERROR_FIELDS if key.endswith(s)), None)
            if suffix is None or value is None:
                continue
            where = f"{row.get('family')} {row.get('pass')} T={row.get('T')}"
            cases.setdefault((key[:-len(suffix)], suffix[1:].replace("_", " "), str(value)), []).append(where)
    lines = []
    for (name, kind, error), where in cases.items():
        shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
        lines.append(f"- {name}, {kind}: `{error}` ({shown})")
    return lines


def cuda_graph_table(moe: dict) -> Optional[str]:
    """The table of the CUDA-only fields (kernels, graph replays, sync checks) of a transformers_moe_cuda
    run, with its columns as the run lists them (`cuda_columns`), those that no row has left out;
    None for runs from before these fields."""
    wanted = moe.get("cuda_columns")
    if not wanted:
        return None
    text = format_table(moe["rows"], present_columns(moe["rows"], wanted))
    failures = cuda_failures(moe["rows"])
    if failures:
        text += ("\n\nFailed captures, synchronisations and kernel counts (first line of the error):\n\n"
                 + "\n".join(failures))
    return text


def decode_line_section(line: dict) -> str:
    """benchmarks/decode_line.py's run: the decode kernel against the grouped path per case, and the
    line each family's times put between them."""
    rows = line["rows"]
    return ("### The decode kernel against the grouped path (where the decode line belongs)\n\n"
            f"`{line.get('command', 'python benchmarks/decode_line.py')}` on {line.get('device_name')} "
            f"(torch {line['machine']['torch']}; finished {line['finished']}), the kernel's limit at "
            f"{line['decode_max_tokens']} tokens during the run.  *decode*: tutel's experts with the decode kernel "
            "wherever its limits allow (no measured line in effect); *grouped*: the same calls with the kernel's "
            "limit at 0 tokens.  Eager times end every call with a "
            "synchronisation; *_graph_ms* are replays of a captured CUDA graph.  *limit_ms*: the chosen "
            "experts' weights read once at the bandwidth measured in the run.\n\n"
            + format_table(rows, present_columns(rows, line["columns"]))
            + "\n\nThe largest T up to which decode is nowhere slower than grouped, and the rows per expert "
              "(T k / E) there:\n\n"
            + format_table(line["lines"], list(line["lines"][0]) if line["lines"] else [])
            + "\n\n`python benchmarks/decode_line.py --apply <this run's file>` sets the line tutel chooses by "
              "from them (tutel/ops/decode_lines.json; a family's line is the smaller of its two, the dtype's "
              "the least over the families where the grouped path won).")


def quantized_experts_cuda_section(result: dict) -> str:
    """benchmarks/quantized_experts.py --device cuda: the quantized experts on a GPU against tutel's bfloat16
    call and transformers' FP8 experts, eager and replayed from CUDA graphs, with the targets judged."""
    rows = result["rows"]
    labelled = [dict(row, family=row.get("model"), **{"pass": "fwd"}) for row in rows]  # as cuda_failures names cases
    skipped = sorted({(name, why) for row in rows for name, why in (row.get("skipped") or {}).items()})
    targets = [{"model": t["model"], "T": t["T"], "target": t["target"], "value": t["value"],
                "met": "not measured: " + str(t.get("why")) if t["met"] is None else "yes" if t["met"] else "**no**"}
               for t in result.get("targets", [])]
    text = ("### Quantized experts on the GPU (`benchmarks/quantized_experts.py --device cuda`)\n\n"
            f"`{result.get('command', 'python benchmarks/quantized_experts.py --device cuda')}` on "
            f"{result.get('device_name')} (torch {result['machine']['torch']}; finished {result['finished']}"
            f"{'; stopped before the end' if result.get('partial') else ''}).  The CPU section's layers and token "
            "counts: `routed_quantized_experts` weight-only in each format (*mxfp4*, *nvfp4*, *fp8_block*), "
            "`routed_experts` in bfloat16 (*bf16*) and, for Qwen3's block-FP8 layer, transformers' `FP8Experts` "
            "over the same FP8 tensors under tutel (*hf_fp8_tutel*: W8A8 as transformers computes; "
            "*_weight_only*) and under its own implementations (*best_hf_fp8*).  *_ms*: eager, CUDA events around "
            "each call started on an idle device with a cold L2; *_graph_ms*: replayed from a CUDA graph; "
            "*limit*: the chosen experts' packed tensors read once at the bandwidth of a 1 GiB sum timed among "
            "the candidates; *_kernels*: kernels one call launches (torch.profiler).\n\n"
            + format_table(rows, present_columns(rows, result["columns"])) + "\n\n"
            + format_table(rows, present_columns(rows, result.get("kernel_columns", []))))
    failures = [f"- {row.get('model')} T={row.get('T')}: the case failed: `{row['error']}`" for row in rows
                if row.get("error")] + cuda_failures(labelled)
    if failures:
        text += "\n\nFailed cases, captures and kernel counts (first line of the error):\n\n" + "\n".join(failures)
    if skipped:
        text += "\n\nNot run:\n\n" + "\n".join(f"- {name}: {why}" for name, why in skipped)
    if targets:
        text += "\n\nTargets:\n\n" + format_table(targets, ["model", "T", "target", "value", "met"])
    return text


def gpu_section(results: Dict[str, dict]) -> str:
    """The GPU runs: transformers' blocks at full size, and tutel's CUDA kernels against a copy."""
    parts = ["## On a GPU", GPU_INTRO]
    moe = results.get("transformers_moe_cuda")
    if moe:
        m = moe["machine"]
        rates = gemm_rates(moe["limits"], "TFLOP/s", 1e3)
        command = re.sub(r" --out \S+", "", moe.get("command", ""))
        columns = [c for c in moe["columns"] if c != "foreign_cpus"]
        parts.append(f"Measured on: {moe.get('device_name')} (host: {m['cpu']}, {m['logical_cpus']} logical CPUs); "
                     f"torch {m['torch']}; finished {moe['finished']}.  Rates before the cases: {rates}, read "
                     f"{moe['limits']['read_gbps']:.0f} GB/s.  Command: `{command}`.\n\n"
                     + format_table(moe["rows"], columns))
        graphs = cuda_graph_table(moe)
        if graphs:
            parts.append("### Kernels per call, CUDA graph replays and host synchronisation\n\n" + graphs)
    line = results.get("decode_line_cuda")
    if line:
        parts.append(decode_line_section(line))
    quantized = results.get("quantized_experts_cuda")
    if quantized:
        parts.append(quantized_experts_cuda_section(quantized))
    kernels = results.get("cuda_kernels")
    if kernels:
        parts.append("### tutel's CUDA kernels against a device-to-device copy\n\n"
                     f"`python benchmarks/cuda_kernels.py` on {kernels['device']} (torch {kernels['torch']}, NVRTC "
                     f"{kernels['nvrtc']}); copy: {kernels['copy_gbps']:.0f} GB/s counting bytes read and written.  "
                     "*GB/s*: the bytes each operator must move at the least over its time (CUDA events, median).\n\n"
                     + format_table(kernels["results"], ["shape", "dtype", "operator", "ms", "gbps",
                                                         "fraction_of_copy"]))
    return "\n\n".join(parts)


def document(results: Dict[str, dict], images: str, doc_path: str) -> str:
    parts = [INTRO, machine_section(results)]
    targets = target_rows(results)
    if targets:
        parts.append("## Targets (2 threads; fp32 unless named)\n\n" + TARGETS_NOTE + format_table(
            targets, ["target", "goal", "measured", "met", "glibc default malloc", "where"]))
        if "transformers_moe" in results:
            parts.append(MISSED_TARGETS_NOTE)
    layer = results.get("layer")
    if layer:
        parts.append("## Bytes and FLOPs per kernel\n\n" + KERNEL_FORMULAS)
        budget = budget_rows(layer)
        if budget:
            shape = layer["profile"]["shape"]
            roof = layer["roofline"]
            parts.append(
                "Measured: one layer step (forward + backward, fp32) at "
                f"T={shape['T']}, M={shape['M']}, H={shape['H']}, "
                f"E={shape['E']}, k={shape['k']}.  *bound* is the time the kernel needs at this machine's measured "
                f"rates: {roof['gemm_gflops']:.0f} GFLOP/s for an fp32 GEMM and {roof['copy_gbps']:.1f} GB/s for a "
                "tensor copy (read + write); GEMM groups are bounded by FLOPs, the others by bytes.  *measured* is "
                "the operators' self CPU time per step in `torch.profiler` (which adds some overhead of its own).  "
                "Kept choices are counted as k*T, an upper bound.\n\n"
                + format_table(budget, ["kernel", "MB", "MFLOP", "bound_ms", "measured_ms", "measured/bound"]))
        limit_rows = with_layer_limit(layer["rows"], (layer.get("roofline") or {}).get("gemm_gflops"))
        columns = list(layer["columns"]) + (["limit_ms", "layer/limit"] if limit_rows is not layer["rows"] else [])
        parts.append("## moe_layer against the ideal (the padded-GEMM baseline), the machine's limit and the naive layer\n\n"
                     "Times in ms per step; peak memory in MiB above the step's start.\n\n"
                     + format_table(*as_baseline(limit_rows, columns)))
    scaling = results.get("scaling")
    if scaling:
        written = plot_scaling(scaling, images)
        pictures = "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, os.path.dirname(doc_path))})"
                             for p in written)
        sweep_t, sweep_e = scaling["token_sweep"], scaling["expert_sweep"]
        parts.append("## Scaling\n\n"
                     f"Token sweep: M={sweep_t['M']}, H={sweep_t['H']}, E={sweep_t['E']}, k={sweep_t['k']}.  "
                     "Expert sweep: "
                     f"T*k={sweep_e['choices']} routed choices, M={sweep_e['M']}, H={sweep_e['H']} (k=1 for one "
                     "expert, else 2).  The naive layer is left out where its [T, E, C] tensors would exceed 1 GiB.\n\n"
                     + pictures + "\n\n" + format_table(*as_baseline(scaling["rows"], scaling["columns"])))
    dispatch = results.get("dispatch")
    if dispatch:
        columns = dispatch["columns"]
        parts.append("## Dispatch and routing\n\n"
                     "Encode is `scatter_slots` (tokens into the `[E, C, M]` buffer), decode is `gather_slots` "
                     "with gates; each one's backward is the other operator (with the gate-gradient dot products "
                     "for decode).  Bytes moved count every row read and written; the copy moves 2N for N bytes.  "
                     "Freed memory is reused while timing, so these are the kernels' own rates (see below).\n\n"
                     + format_table(dispatch["dispatch"], columns["dispatch"])
                     + "\n\nRouting (`route_topk` = top-k plus GShard slot assignment; `_bpr` = batch-prioritized, "
                       "which adds a stable sort by score):\n\n"
                     + format_table(dispatch["routing"], columns["routing"])
                     + "\n\nRouting metadata (indices, locations and gates as k x [T], counts as [E]) against k "
                       "dense float32 [T, E] masks; *routing_peak_mib* is what `top_k_routing` adds above its "
                       "[T, E] input:\n\n"
                     + format_table([dispatch["metadata"]], columns["metadata"]))
    dropless = results.get("dropless")
    if dropless:
        parts.append("## Dropless without padding\n\n"
                     "`capacity_factor=0`.  *grouped*: `megablocks_size=1`, tokens dispatched straight into each "
                     "expert's real rows and the expert GEMMs run per expert over those rows only (one "
                     "`grouped_linear` operator call per layer).  *padded*: every expert padded to the busiest "
                     "one's load.  *baseline* (`ideal` in the JSON): the gate GEMM plus one dense FFN per expert over "
                     "exactly its tokens.  "
                     "Skewed routing (`zipf`): every token picks expert 0 and a second expert from a Zipf law "
                     f"(exponent {dropless['zipf_exponent']}).\n\n"
                     + format_table(*as_baseline(dropless["rows"], dropless["columns"])))
    if results.get("dist_alltoall"):
        parts.append(exchange_section(results["dist_alltoall"]))
    if results.get("transformers_moe"):
        picture = plot_transformers(results["transformers_moe"], images)
        link = f"![transformers]({os.path.relpath(picture, os.path.dirname(doc_path))})\n\n" if picture else ""
        parts.append(transformers_section(results["transformers_moe"], link))
    if results.get("transformers_moe_16bit_large"):
        large = results["transformers_moe_16bit_large"]
        parts.append("### 16-bit cases at large T (a separate run)\n\n"
                     "The same measurement for the 16-bit cases the run above skips, finished "
                     f"{large['finished']}: `{large.get('command')}`.  Rates before the cases: "
                     + gemm_rates(large["limits"])
                     + f", read {large['limits']['read_gbps']:.1f} GB/s.\n\n"
                     + format_table(large["rows"], large["columns"]))
    if results.get("transformers_moe_full_size"):
        full = results["transformers_moe_full_size"]
        parts.append("### Published layer shapes at decoding sizes (a separate run)\n\n"
                     "The layers of the scaled run above are small enough that fixed costs of a call (transformers' "
                     "own dispatch to the experts implementation, about 85 us with the caches cold, and tutel's "
                     "checks) weigh against the bandwidth limit at T = 1.  The published models' own layer shapes "
                     "(`--full-size`: Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b; DeepSeek-V3's 256 experts of "
                     "7168 x 2048 do not fit this machine's memory in float32) read 3-16x more weight bytes per "
                     f"token.  Finished {full['finished']}: `{full.get('command')}`.  Rates before the cases: "
                     + gemm_rates(full["limits"])
                     + f", read {full['limits']['read_gbps']:.1f} GB/s.\n\n"
                     + format_table(full["rows"], full["columns"]))
    if results.get("grouped_gemm"):
        parts.append(grouped_gemm_section(results["grouped_gemm"]))
    parts.append(CPU_GEMM_LINES)
    parts.append(DESIGN_MEASUREMENTS)
    if results.get("compare_builds"):
        parts.append(compare_builds_section(results["compare_builds"]))
    if results.get("host_cost"):
        parts.append(host_cost_section(results["host_cost"]))
    if results.get("quantized_experts"):
        parts.append(quantized_experts_section(results["quantized_experts"]))
    if results.get("quantized_linear"):
        parts.append(quantized_linear_section(results["quantized_linear"]))
    if any(results.get(name) for name in GPU_BENCHMARKS):
        parts.append(gpu_section(results))
    parts.append(NOTES)
    return "\n\n".join(parts) + "\n"


NOTES = """## Notes

* **Allocation.**  Under glibc's default malloc, blocks above 32 MiB are always mmap'd and smaller
  ones are often given back to the OS after use, so an operator that returns a large fresh tensor
  first pays the kernel for faulting its pages in (zero-filled) - on this VM a few GB/s, slower
  than the operators themselves.  How often that happens depends on tensor sizes and allocation
  history, not on the code measured: the baseline gets its `[E, C, M]` inputs ready-made while the
  layer allocates its dispatch buffers, and a grouped `[N, H]` activation crosses 32 MiB where the
  baseline's per-expert pieces do not.  So the timings are taken with glibc told to keep freed memory
  for reuse (`mallopt(M_MMAP_MAX, 0)`, no trimming), which is what the caching allocators that
  PyTorch recommends for CPU training (jemalloc, tcmalloc) do; the layer and dropless benchmarks
  also report their ratios under glibc's defaults (`*_glibc` columns), measured first in the same
  process.
* **Fresh pages.**  *extra_fault_mib* is the memory the layer's step faults in (first touches,
  zero-filled by the kernel) beyond the baseline's.  It is near zero while freed memory is reused;
  where it is not (the largest token counts, whose `[E, C, M]` buffers are hundreds of MiB and do
  not fit back into the fragmented heap), the ratio there measures the page faults (expensive in
  this VM: a few microseconds per 4 KiB page) more than the layer's own work.
* **Vectorised kernels.**  The dispatch kernels pick AVX2 + F16C code at run time when the CPU has
  it (the build cannot assume `-march=native`); results are bitwise the same as the portable code.
* **Threads.**  The extension is compiled with `-fopenmp`: PyTorch's `at::parallel_for` expands to
  an OpenMP pragma inside the extension's own code, so without the flag every kernel ran on one
  thread whatever `torch.set_num_threads` said.
* **Dropless.**  The grouped path reads the expert loads on the host once per call (the shapes
  depend on them), as the padded dropless path does for its capacity.
"""


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS_DIR, help="directory holding the benchmarks' JSON")
    parser.add_argument("--doc", default=DOC, help="markdown file to write")
    parser.add_argument("--images", default=IMAGES, help="directory for the PNG plots")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if not any(name in results for name in BENCHMARKS):
        raise SystemExit(f"no benchmark results in {args.results}; run the benchmarks first")
    text = document(results, args.images, args.doc)
    os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
    with open(args.doc, "w") as handle:
        handle.write(text)
    print(f"wrote {args.doc}")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
