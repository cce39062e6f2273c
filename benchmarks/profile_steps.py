# SPDX-License-Identifier: Apache-2.0
"""Where an engine step's time goes, dense against duo (issue 22): step wall times and a torch profile.

One in-process vLLM engine per run (`--backend dense` or `duo`), CUDA graphs and prefix caching on, as served:

  decode: B requests of C context tokens decoding together; the timed steps are decode-only (full CUDA graphs);
          `decode_served`: 32 more stepped as served, wall time a step (what a server's inter-token latency is).
  mixed:  the chat_turns case. The B documents are cached; B - 1 requests decode and one more arrives that hits
          its document's C tokens and prefills N new ones. The timed step is the one that holds that prefill
          (piecewise graphs, attention eager), against the decode-only step after it; the profile covers both.
  burst:  K new prompts of L tokens at once (short_itl's TTFT case): the chunked-prefill steps until every one has
          its first token, profiled over a whole burst (per step: the burst's steps on average).

`--timeline R` runs bursts only, stepped as served (no sync between steps: asynchronous scheduling overlaps a step's
host work with the GPU's previous step): a warm-up burst, R timed ones (each request's time to its first token from
its arrival, the burst's start unless `--burst-arrival-ms`; the burst's wall time) and one under the torch profiler,
whose trace splits the burst's wall time into GPU busy and GPU idle (vllm_duo/tools/bench/timeline.py) and names
what the host did in the longest idle gaps.
Dense beside duo, that tells a TTFT gap made of kernel time from one made of host time the GPU waited for.

It prints and writes (`--out`, JSON) the median wall time of each kind of step (`engine.step()`: schedule, model,
sampling, outputs), the torch profiler's top CUDA kernels and CPU ops over P steps of each kind, per step, and
cProfile's top Python functions over another P (the Python under a custom op, Triton's launcher included).
Kernels inside a full CUDA graph show as one graph launch. The wall times do not include the GPU finishing a step
(`engine.step()` returns before; the next step's start waits for it, untimed): compare device times and counts.
Run once per backend on the same machine:

    python benchmarks/profile_steps.py --backend dense --model /tmp/llama8b --tokenizer /tmp/smol --load-format dummy
    python benchmarks/profile_steps.py --backend duo ... --pattern Meta-Llama-3.1-8B-Instruct --sparsity 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one profile


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("dense", "duo"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--pattern", default="Meta-Llama-3.1-8B-Instruct")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--squeeze", type=float, metavar="BUDGET",
                   help="duo with the squeeze (issue 33) at this budget: every document is clustered at its prefill")
    p.add_argument("--batch", type=int, default=16, help="B: requests at once")
    p.add_argument("--context", type=int, default=16000, help="C: tokens of each request's document")
    p.add_argument("--new-tokens", type=int, default=384, help="N: tokens the arriving request prefills past its hit")
    p.add_argument("--steps", type=int, default=8, help="P: profiled steps of each kind")
    p.add_argument("--burst", type=int, default=32, help="K: prompts in the burst, at once (0: no burst)")
    p.add_argument("--burst-len", type=int, default=1024, help="L: tokens of each burst prompt")
    p.add_argument("--burst-out", type=int, default=1, metavar="O",
                   help="--timeline: tokens each burst prompt generates (served short_itl: 256; from its first on, "
                        "its decode rows join the burst's later prefill steps); the burst ends at the last first token")
    p.add_argument("--burst-arrival-ms", type=float, default=0.0, metavar="A",
                   help="--timeline: the burst's prompts arrive evenly over A ms (0: all at once), each added before "
                        "the first step after its arrival, as a server's engine core takes its input between steps; "
                        "TTFT from each prompt's arrival")
    p.add_argument("--max-num-batched-tokens", type=int, help="the engine's token budget a step (default vLLM's)")
    p.add_argument("--timeline", type=int, default=0, metavar="R",
                   help="bursts only: R timed and one profiled, stepped as served (see above)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the CPU stack)")
    p.add_argument("--out", help="JSON file for the results")
    return p.parse_args(argv)


def build_engine(args):
    from vllm import LLM

    engine = dict(model=args.model, tokenizer=args.tokenizer or args.model, load_format=args.load_format,
                  dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.context + 1024,
                  enable_prefix_caching=True, enforce_eager=args.enforce_eager, seed=0)
    if args.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.backend == "duo":
        duo = {"pattern": args.pattern, "sparsity": args.sparsity}
        if args.squeeze:
            duo["squeeze"] = {"budget": args.squeeze, "min_context_len": 1024, "max_contexts": args.batch + 1}
        engine.update(attention_backend="duo", additional_config={"duo": duo})
    return LLM(**engine)


def documents(batch: int, length: int, vocab: int = 30000, seed: int = 0) -> list[list[int]]:
    """Distinct token documents (token ids 1000..1000+vocab, seeded), one per request."""
    import random

    rng = random.Random(seed)
    return [[1000 + rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


class Steps:
    """Drives `engine.step()` and times each step, labelled by what it ran."""

    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams, TokensPrompt

        self.engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                                # no detokenizing: in this process it would be timed as the step's (dummy weights'
                                # tokens cost the tokenizer ~20 ms per request per step)
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                               detokenize=False))

    def step(self, kind: str | None = None) -> None:
        import torch

        torch.cuda.synchronize() if torch.cuda.is_available() else None
        start = time.perf_counter()
        self.engine.step()
        if kind:
            self.times.setdefault(kind, []).append((time.perf_counter() - start) * 1e3)

    def unsynced_ms(self, count: int) -> float:
        """Wall time per step of `count` steps stepped as served (no sync between them: asynchronous scheduling
        overlaps a step's host work with the GPU's previous step), once the GPU has finished them."""
        import torch

        synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        synchronize()
        start = time.perf_counter()
        for _ in range(count):
            self.engine.step()
        synchronize()
        return (time.perf_counter() - start) * 1e3 / count

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def profile(run_steps, steps: int) -> dict:
    """The torch profiler over `run_steps()`: top CUDA kernels and CPU ops, per step."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        run_steps()
    events = prof.key_averages()
    device_time = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    kernels = sorted((e for e in events if device_time(e) > 0), key=device_time, reverse=True)
    cpu_ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"kernels": [{"name": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": device_time(e) / steps}
                        for e in kernels[:25]],
            "device_us_per_step": sum(device_time(e) for e in events) / steps,
            "launches_per_step": sum(e.count for e in kernels) / steps,
            "cpu_ops": [{"name": e.key[:90], "calls_per_step": e.count / steps,
                         "self_cpu_us_per_step": e.self_cpu_time_total / steps} for e in cpu_ops[:25]]}


def python_profile(run_steps, steps: int) -> list[dict]:
    """cProfile over `run_steps()`: the Python functions with the most own time per step (the torch profiler
    attributes a custom op's Python, Triton's launcher included, to the op's self time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run_steps)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:30]
    return [{"function": f"{path.rsplit('/', 2)[-1]}:{line}({name})", "calls_per_step": calls / steps,
             "own_us_per_step": own * 1e6 / steps, "cumulative_us_per_step": cumulative * 1e6 / steps}
            for (path, line, name), (_, calls, own, cumulative, _) in rows]


def burst_timeline(steps: Steps, args) -> dict:
    """`--timeline R`: K fresh prompts of L tokens (at once or as they arrive), stepped without a sync until each has
    its first token; a warm-up burst, R timed and one profiled (module docstring). Times in ms from the burst's
    start, TTFT from each prompt's arrival (`--burst-arrival-ms`). Each prompt generates O tokens (`--burst-out`):
    from its first on, its decode row joins the burst's later steps."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, record_function

    from vllm_duo.tools.bench.timeline import gpu_timeline, load_trace

    prompts = documents((args.timeline + 2) * args.burst, args.burst_len, seed=2)
    bursts = iter(enumerate(prompts[i:i + args.burst] for i in range(0, len(prompts), args.burst)))

    def burst() -> dict:
        """One burst until every prompt has its first token (its other tokens are `drain`'s, untimed)."""
        number, batch = next(bursts)
        names = [f"timeline{number}-{i}" for i in range(len(batch))]
        arrivals = [i * args.burst_arrival_ms / max(len(batch) - 1, 1) for i in range(len(batch))]
        start, added, count, first = time.perf_counter(), 0, 0, {}
        while len(first) < len(batch):
            now = (time.perf_counter() - start) * 1e3
            while added < len(batch) and arrivals[added] <= now:
                steps.add(names[added], batch[added], args.burst_out)
                added += 1
            if not steps.engine.has_unfinished_requests():
                if added == len(batch):
                    break
                time.sleep((arrivals[added] - now) / 1e3)
                continue
            outputs = steps.engine.step()
            count += 1
            first.update({output.request_id: (time.perf_counter() - start) * 1e3 for output in outputs
                          if output.request_id not in first and output.outputs and output.outputs[0].token_ids})
        times = sorted(first[name] - arrival for name, arrival in zip(names, arrivals) if name in first)
        return {"steps": count, "wall_ms": (time.perf_counter() - start) * 1e3, "mean_ttft_ms": statistics.mean(times),
                "p99_ttft_ms": times[min(len(times) - 1, len(times) * 99 // 100)]}

    def drained(run: dict) -> dict:
        steps.drain()
        return run

    drained(burst())
    timed = [drained(burst()) for _ in range(args.timeline)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        with record_function("burst"):
            profiled = burst()
    steps.drain()
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        events = load_trace(f"{folder}/trace.json")
    window = next((e["ts"], e["ts"] + e["dur"]) for e in events  # the host's range (not its GPU-side mirror)
                  if e["name"] == "burst" and e.get("cat") == "user_annotation")
    profiled["gpu"] = gpu_timeline(events, window, exclude=("burst",))
    median = {key: statistics.median(run[key] for run in timed) for key in ("wall_ms", "mean_ttft_ms", "p99_ttft_ms")}
    return {"timed": timed, "median": median, "profiled": profiled}


def print_timeline(label: str, timeline: dict) -> None:
    median, profiled, gpu = timeline["median"], timeline["profiled"], timeline["profiled"]["gpu"]
    print(f"== {label}: {len(timeline['timed'])} bursts, median wall {median['wall_ms']:.1f} ms, mean TTFT "
          f"{median['mean_ttft_ms']:.1f}, p99 TTFT {median['p99_ttft_ms']:.1f}")
    print(f"-- profiled burst: {profiled['steps']} steps, {gpu['window_ms']:.1f} ms: GPU busy {gpu['busy_ms']:.1f}, "
          f"idle {gpu['idle_ms']:.1f} ({gpu['idle_gaps']} gaps of 0.2 ms or more); the longest:")
    for gap in gpu["longest_gaps"]:
        print(f"   {gap['ms']:7.2f} ms at {gap['at_ms']:7.1f}: {'; '.join(gap['host'])}")
    print("   host time by vLLM's scopes: " + "; ".join(f"{name} {ms:.1f} ms"
                                                       for name, ms in list(gpu["host_ms_by_scope"].items())[:8]))
    print("   device time by kernel: " + "; ".join(f"{name[:60]} {ms:.1f} ms"
                                                  for name, ms in gpu["device_ms_by_kernel"].items()))
    print("   idle time by the launch it waited for: " + "; ".join(
        f"{name} {entry['ms']:.1f} ms ({entry['gaps']} gaps)" for name, entry in gpu["idle_ms_by_launch"].items()))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.timeline:  # vLLM's own profiling scopes (schedule, preprocess, forward, sample ...) in the trace
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    llm = build_engine(args)
    steps = Steps(llm)
    if args.timeline:
        result = {"timeline": burst_timeline(steps, args), "settings": {k: v for k, v in vars(args).items()
                                                                        if k != "out"}}
        print_timeline(args.backend, result["timeline"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return result
    docs = documents(args.batch, args.context)
    for i, doc in enumerate(docs):  # fill the prefix cache: every document prefilled once
        steps.add(f"fill{i}", doc, 1)
    steps.drain()

    # decode: B requests decoding (their documents hit the cache), timed once all are past their prefill
    for i, doc in enumerate(docs):
        steps.add(f"dec{i}", doc + [7] * 16, 1000)
    for _ in range(8):
        steps.step()
    for _ in range(16):
        steps.step("decode")
    decode_served_ms = steps.unsynced_ms(32)
    result = {"decode": profile(lambda: [steps.step() for _ in range(args.steps)], args.steps)}
    result["decode"]["python"] = python_profile(lambda: [steps.step() for _ in range(args.steps)], args.steps)
    steps.engine.abort_request([f"dec{i}" for i in range(args.batch)])
    steps.drain()

    # mixed: B - 1 decoding, then one arriving request that hits its document and prefills N new tokens
    new = [11] * args.new_tokens
    for i, doc in enumerate(docs[1:], start=1):
        steps.add(f"mix{i}", doc + [7] * 16, 1000)
    for _ in range(8):
        steps.step()

    def mixed_steps(label):
        for k in range(args.steps):
            steps.add(f"arrive{label}{k}", docs[0] + [label, k] + new, 1)
            steps.step("mixed" if label == 5 else None)  # holds the arriving request's prefill (and its one token)
            steps.step("decode_between" if label == 5 else None)

    mixed_steps(3)  # warm-up: first hits of this shape
    mixed_steps(5)
    result["mixed"] = profile(lambda: mixed_steps(9), args.steps)
    result["mixed"]["python"] = python_profile(lambda: mixed_steps(13), args.steps)
    steps.engine.abort_request([f"mix{i}" for i in range(1, args.batch)])
    steps.drain()

    if args.burst:  # K fresh prompts at once until each has its first token: a warm-up, a timed, a profiled burst
        prompts = documents(4 * args.burst, args.burst_len, seed=1)  # none shares a block with the documents
        bursts = iter(enumerate(prompts[i::4] for i in range(4)))

        def burst(kind=None):
            number, batch = next(bursts)
            for i, prompt in enumerate(batch):
                steps.add(f"burst{number}-{i}", prompt, 1)
            count = 0
            while steps.engine.has_unfinished_requests():
                steps.step(kind)
                count += 1
            return count

        burst()
        result["burst_steps"] = burst("burst")
        result["burst"] = profile(burst, result["burst_steps"])
        result["burst"]["python"] = python_profile(burst, result["burst_steps"])
        result["burst_ms"] = sum(steps.times["burst"])

    result["step_ms"] = {kind: statistics.median(times) for kind, times in steps.times.items()}
    result["step_ms"]["decode_served"] = decode_served_ms
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    label = args.backend if args.squeeze is None else f"{args.backend} squeeze {args.squeeze:g}"
    print(f"== {label}: median step ms {json.dumps({k: round(v, 2) for k, v in result['step_ms'].items()})}")
    for kind in ("decode", "mixed", "burst"):
        if kind not in result:
            continue
        r = result[kind]
        print(f"-- {kind}: {r['launches_per_step']:.0f} kernel launches, {r['device_us_per_step']:.0f} us device "
              f"time per step (mixed: per pair of a prefill step and a decode step; burst: "
              f"{result.get('burst_steps')} steps, {result.get('burst_ms', 0):.0f} ms in all)")
        for e in r["kernels"][:12]:
            print(f"   {e['us_per_step']:9.1f} us {e['calls_per_step']:6.1f}x  {e['name']}")
        print("   top CPU ops (self):")
        for e in r["cpu_ops"][:8]:
            print(f"   {e['self_cpu_us_per_step']:9.1f} us {e['calls_per_step']:6.1f}x  {e['name']}")
        print("   top Python functions (own time, cProfile):")
        for e in r["python"][:12]:
            print(f"   {e['own_us_per_step']:9.1f} us {e['calls_per_step']:6.1f}x  {e['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
