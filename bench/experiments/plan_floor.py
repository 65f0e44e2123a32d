"""What FlashInfer's compiled MLAPlan costs by itself, and what it writes.

The fast re-plan's floor is one call of FlashInfer 0.7's native fa2/fa3 MLAPlan (scheduler.cuh)
through tvm-ffi. This separates the two parts of that call on the GPU host, interleaving the rows
round by round so host drift hits all of them alike:

  ffi_nop_torch   tvm-ffi's `testing.nop` with the plan's six tensors as torch tensors
  ffi_nop_ffi     the same six tensors converted to tvm_ffi.Tensor once, beforehand
  mlaplan_torch   the native plan call as the fast re-plan makes it (torch tensors, no upload)
  mlaplan_ffi     the same with pre-converted tensors (the C++ scheduler + call overhead only)

per heads (16, 128) and batch (1, 32, 128) at a ragged context ~4096, page 64. Then the numpy
schedule that replaces MLAPlan (vllm_metax.ops.mla_schedule) on the host, whole and as decode
steps, for B = 1-256; and the decode kernel's GPU time on MLAPlan's schedule vs the numpy one
(which balances the clusters differently). It also saves what MLAPlan wrote for a set of batches
(decode, speculative causal, long context) to schedules.npz: inputs, plan info and every schedule
array, so the numpy schedule can be checked against it off the GPU (tests/test_mla_schedule.py).

    source .carry/device-env.sh && python3 bench/experiments/plan_floor.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PAGE = 64


def stats(ns: list[int]) -> dict:
    us = sorted(x / 1e3 for x in ns)
    q = statistics.quantiles(us, n=10)
    return {"p50_us": statistics.median(us), "p10_us": q[0], "p90_us": q[-1], "n": len(us)}


def interleaved(fns: dict, rounds: int, warmup: int = 20) -> dict:
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            f()
            samples[k].append(time.perf_counter_ns() - t0)
    return {k: stats(v) for k, v in samples.items()}


def planned_backend(num_heads: int, lens: list[int], q_len: int, causal: bool):
    from vllm_metax.ops import flashinfer_mla as op
    from vllm_metax.ops.paged_metadata import build_paged_metadata

    pages = [-(-n // PAGE) for n in lens]
    width = max(pages) + 2
    table = torch.arange(len(lens) * width, dtype=torch.int32, device="cuda").reshape(len(lens), width)
    meta = build_paged_metadata(table, np.asarray(lens, np.int32), PAGE, q_len, compact=False)
    kernel = op.MLADecodeKernel(op.make_workspace("cuda"), "fa3")
    kernel.plan(meta.compacted(), num_heads, 512, 64, PAGE, causal, 0.1, torch.bfloat16, torch.bfloat16)
    be = kernel.wrapper._planned_backend
    return be, meta


def read_schedule(be, info: list[int], staged: int) -> dict:
    """What MLAPlan wrote into the backend's pinned buffer, array by array."""
    from vllm_metax.ops import mla_schedule as ms

    host = be._pin_memory_int_workspace_buffer.view(torch.uint8)[:staged].numpy().view(np.int32)
    s = ms.read_schedule(info, host, torch.cuda.get_device_properties(0).multi_processor_count)
    return {"work_indptr": s.work_indptr, **s.works, **s.merges}


def numpy_vs_native(rounds: int) -> list:
    """Host cost of one schedule: FlashInfer's MLAPlan vs the numpy schedule + its write into the
    staging buffer, computed whole (a new batch) and as decode steps (reused from the step
    before while its shape holds), per batch size."""
    from vllm_metax.ops import mla_schedule as ms

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads in (16, 128):
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            lens = np.random.default_rng(batch).integers(2048, 6144, batch).tolist()
            be, meta = planned_backend(heads, lens, 1, False)
            native = be._cached_module._module.plan
            pinned = be._pin_memory_int_workspace_buffer
            info, staged = native(be._float_workspace_buffer, be._int_workspace_buffer, pinned,
                                  meta.qo_indptr, meta.kv_indptr, meta.kv_len, heads, 512, False)
            layout = ms.ScheduleLayout(tuple(int(x) for x in info), int(staged), sms)
            host = torch.empty_like(pinned).view(torch.uint8).numpy().view(np.int32)
            qo, kvi, kvl = meta.qo_indptr, meta.kv_indptr, meta.kv_len

            def fresh():                      # nothing to reuse: the whole schedule
                ms.clear_reuse()
                s = ms.mla_schedule(qo.numpy(), kvi.numpy(), kvl.numpy(), heads, False, sms, q_len=1)
                layout.write(s, host)
            growing = [kvl.numpy() + i for i in range(32)]
            state = {"i": 0, "holds": None}

            def step():                       # decode: every request a token longer each step
                s = ms.mla_schedule(qo.numpy(), kvi.numpy(), growing[state["i"] % 32], heads, False,
                                    sms, q_len=1)
                state["i"] += 1
                layout.write(s, host, holds=state["holds"])
                state["holds"] = s.structure
            fns = {"mlaplan": lambda: native(be._float_workspace_buffer, be._int_workspace_buffer, pinned,
                                             qo, kvi, kvl, heads, 512, False),
                   "numpy_schedule": fresh, "numpy_step": step}
            st = interleaved(fns, rounds)
            rows.append({"heads": heads, "batch": batch, **{f"{k}_p50_us": v["p50_us"] for k, v in st.items()},
                         **{f"{k}_p90_us": v["p90_us"] for k, v in st.items()}})
            print(rows[-1], flush=True)
    return rows


def kernel_time_by_schedule() -> list:
    """GPU time of the decode kernel on FlashInfer's schedule vs the numpy one (same batch; the
    numpy schedule balances the clusters differently), and the difference of their outputs."""
    from vllm_metax.ops import fast_replan as fr, flashinfer_mla as op

    rows = []
    for heads in (16, 128):
        for batch, lo, hi in ((32, 2048, 6144), (64, 1, 32768), (128, 2048, 6144), (128, 100, 16384)):
            g = np.random.default_rng(batch + hi)
            lens = g.integers(lo, hi, batch).tolist()
            pages = sum(-(-n // PAGE) for n in lens)
            kv = torch.randn(pages + 1, PAGE, 576, device="cuda", dtype=torch.bfloat16)
            width = max(-(-n // PAGE) for n in lens)
            table = torch.zeros(batch, width, dtype=torch.int32)
            o = 0
            for b, n in enumerate(lens):
                k = -(-n // PAGE)
                table[b, :k] = torch.arange(o, o + k)
                o += k
            from vllm_metax.ops.paged_metadata import build_paged_metadata
            meta = build_paged_metadata(table.cuda(), np.asarray(lens, np.int32), PAGE, compact=False)
            q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
            kern = op.MLADecodeKernel(op.make_workspace("cuda"), "fa3")
            args = (heads, 512, 64, PAGE, False, 0.1, torch.bfloat16, torch.bfloat16)
            kern.plan(meta.compacted(), *args)                     # public plan
            res = {}
            for name, cut in (("mlaplan", 1 << 30), ("numpy", 0)):
                fr.SCHEDULE_MIN_BATCH = cut
                kern.plan(meta, *args)                             # fast re-plan: learns, then numpy
                before = dict(fr.SCHEDULES)
                kern.plan(meta, *args)
                assert fr.SCHEDULES[name] == before[name] + 1, (name, fr.SCHEDULES)
                out = kern.run(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:])
                times = []
                for _ in range(7):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(50):
                        kern.run(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:])
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) / 50 * 1e3)
                res[name] = (statistics.median(times), min(times), max(times), out.float())
            fr.SCHEDULE_MIN_BATCH = 16
            diff = float((res["numpy"][3] - res["mlaplan"][3]).norm() / res["mlaplan"][3].norm())
            rows.append({"heads": heads, "batch": batch, "lens": f"{lo}-{hi}",
                         "mlaplan_us": res["mlaplan"][0], "numpy_us": res["numpy"][0],
                         "mlaplan_range": res["mlaplan"][1:3], "numpy_range": res["numpy"][1:3],
                         "rel_diff": diff})
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU, and torch sees none here: run it on the GPU machine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tvm_ffi

    env = {"torch": torch.__version__, "tvm_ffi": tvm_ffi.__version__,
           "device": torch.cuda.get_device_name(0),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}
    print(env, flush=True)
    result = {"environment": env, "timing": [], "schedules": []}

    nop = tvm_ffi.get_global_func("testing.nop", allow_missing=True)
    for heads in (16, 128):
        for batch in (1, 32, 128):
            g = np.random.default_rng(batch)
            lens = g.integers(2048, 6144, batch).tolist()
            be, meta = planned_backend(heads, lens, 1, False)
            native = be._cached_module._module.plan
            targs = [be._float_workspace_buffer, be._int_workspace_buffer,
                     be._pin_memory_int_workspace_buffer, meta.qo_indptr, meta.kv_indptr, meta.kv_len]
            fargs = [tvm_ffi.from_dlpack(t) for t in targs]
            fns = {"mlaplan_torch": lambda: native(*targs, heads, 512, False),
                   "mlaplan_ffi": lambda: native(*fargs, heads, 512, False)}
            if nop is not None:
                fns["ffi_nop_torch"] = lambda: nop(*targs, heads, 512, False)
                fns["ffi_nop_ffi"] = lambda: nop(*fargs, heads, 512, False)
            for name, st in interleaved(fns, args.rounds).items():
                result["timing"].append({"heads": heads, "batch": batch, "what": name, **st})
            # the C++ part alone: back-to-back calls, no sync between them
            n = 2000
            t0 = time.perf_counter_ns()
            for _ in range(n):
                native(*fargs, heads, 512, False)
            result["timing"].append({"heads": heads, "batch": batch, "what": "mlaplan_ffi_loop_mean",
                                     "p50_us": (time.perf_counter_ns() - t0) / n / 1e3, "n": n})
            print(heads, batch, {r["what"]: round(r["p50_us"], 1) for r in result["timing"]
                                 if r["heads"] == heads and r["batch"] == batch}, flush=True)

    result["numpy_vs_native"] = numpy_vs_native(args.rounds)
    result["kernel"] = kernel_time_by_schedule()

    arrays = {}
    cases = [(16, [4096], 1, False), (16, [100, 5000, 7, 64, 65, 3000], 1, False),
             (128, [4096], 1, False), (128, [33000, 10, 500], 1, False),
             (16, np.random.default_rng(1).integers(2048, 6144, 128).tolist(), 1, False),
             (128, np.random.default_rng(2).integers(2048, 6144, 128).tolist(), 1, False),
             (16, np.random.default_rng(3).integers(1, 32768, 64).tolist(), 1, False),
             (16, np.random.default_rng(4).integers(3, 9000, 40).tolist(), 3, True),
             (128, np.random.default_rng(5).integers(2, 9000, 40).tolist(), 2, True),
             (32, np.random.default_rng(6).integers(2, 20000, 200).tolist(), 4, True),
             (16, [1] * 256, 1, False), (64, [2] * 8, 2, True)]
    sms = env["sms"]
    for k, (heads, lens, q_len, causal) in enumerate(cases):
        be, meta = planned_backend(heads, lens, q_len, causal)
        native = be._cached_module._module.plan
        info, staged = native(be._float_workspace_buffer, be._int_workspace_buffer,
                              be._pin_memory_int_workspace_buffer, meta.qo_indptr, meta.kv_indptr,
                              meta.kv_len, heads, 512, causal)
        info = [int(x) for x in info]
        torch.cuda.synchronize()
        sched = read_schedule(be, info, int(staged))
        arrays[f"c{k}_in_qo_indptr"] = meta.qo_indptr.numpy()
        arrays[f"c{k}_in_kv_indptr"] = meta.kv_indptr.numpy()
        arrays[f"c{k}_in_kv_len"] = meta.kv_len.numpy()
        arrays[f"c{k}_in_case"] = np.asarray([heads, q_len, int(causal), sms])
        arrays[f"c{k}_plan_info"] = np.asarray(info, np.int64)
        for name, a in sched.items():
            arrays[f"c{k}_out_{name}"] = a
        result["schedules"].append({"case": k, "heads": heads, "batch": len(lens), "q_len": q_len,
                                    "causal": causal, "staged": int(staged), "works": int(sched["work_indptr"][-1])})
    np.savez_compressed(out / "schedules.npz", **arrays)
    (out / "plan_floor.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| heads | batch | what | p50 us | p10 | p90 |")
    for r in result["timing"]:
        print(f"| {r['heads']} | {r['batch']} | {r['what']} | {r['p50_us']:.1f} | {r.get('p10_us', 0):.1f} | "
              f"{r.get('p90_us', 0):.1f} |")
    print("| heads | batch | MLAPlan p50 us | numpy schedule+write p50 us | numpy decode step p50 us |")
    for r in result["numpy_vs_native"]:
        print(f"| {r['heads']} | {r['batch']} | {r['mlaplan_p50_us']:.1f} | {r['numpy_schedule_p50_us']:.1f} | "
              f"{r['numpy_step_p50_us']:.1f} |")
    print("| heads | batch | lens | kernel on MLAPlan us | kernel on numpy us | rel diff |")
    for r in result["kernel"]:
        print(f"| {r['heads']} | {r['batch']} | {r['lens']} | {r['mlaplan_us']:.1f} | {r['numpy_us']:.1f} | "
              f"{r['rel_diff']:.1e} |")
    print(result["schedules"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
