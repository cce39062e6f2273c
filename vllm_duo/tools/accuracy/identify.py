# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo identify`: trains the gates (training.py) in one or several processes and writes them as a pattern."""
from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vllm_duo.pattern import HeadPattern, PatternError, read_hf_config
from vllm_duo.tools.accuracy.training import (LENGTH_INTERVALS, REPEATED_PERIOD, IdentifySettings, TrainResult,
                                              checkpoint_steps, initial_pattern, train)
from vllm_duo.tools.pattern_commands import pattern_from_gates, show, with_trained_mask
from vllm_duo.tools.processes import free_port

SOURCE = "vllm-duo identify"
GPU_MIN_CONTEXT_LEN = 1000  # the paper's shortest training prompt
DEFAULT_WINDOW = 64 + 256  # the sink + recent that 1000 tokens were chosen with


def default_context_len(model_dir: str | Path, device: str | None = None) -> int:
    """On GPU the model's usable context (max_position_embeddings, at most the reference's 32000); 2048 on CPU,
    where a step at 8k tokens takes minutes."""
    if not _on_cuda(device):
        return 2048
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return min(int(config.get("max_position_embeddings") or 32000), 32000)


def default_min_context_len(context_len: int, device: str | None = None, sink: int = 64, recent: int = 256) -> int:
    """On GPU the paper's 1000 tokens, plus what a window wider than the default 64 + 256 takes, so that the
    shortest prompt keeps as much haystack outside sink and window for its passkeys (at most context_len); half of
    context_len on CPU, where prompts are short."""
    if not _on_cuda(device):
        return context_len // 2
    return min(GPU_MIN_CONTEXT_LEN + max(0, sink + recent - DEFAULT_WINDOW), context_len)


def _on_cuda(device: str | None) -> bool:
    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


# What one gate covers, for the provenance: per KV head (DuoAttention) or per layer (ZigzagAttention's fine-tuning,
# from which `vllm-duo pattern zigzag` picks the layers with the smallest gates).
_GATE_KINDS = {False: "one gate alpha per layer and KV head",
               True: "one gate per layer shared by its KV heads (ZigzagAttention's layer-wise alphas)"}


def build_pattern(model_dir: str | Path, settings: IdentifySettings, result: TrainResult, *, name: str | None = None,
                  aliases: Sequence[str] = (), sparsity: float | None = None, deploy_sink: int | None = None,
                  deploy_recent: int | None = None, date: str | None = None,
                  license: str | None = None) -> HeadPattern:
    """A HeadPattern with the trained gates and a provenance that names every hyperparameter.

    It is deployed with the training sink/recent unless deploy_sink/deploy_recent say otherwise: the gates rank
    heads for the window they were trained with. With a target sparsity S the pattern also stores the trained mask
    as masks[S] (default sparsity: S); with an initial pattern it is that pattern, masks[S] added and the run
    described in its notes (its gates, names, sparsity and window kept, the options here unused).
    """
    deploy_sink = settings.sink if deploy_sink is None else deploy_sink
    deploy_recent = settings.recent if deploy_recent is None else deploy_recent
    target = settings.target_sparsity
    length = (f"{settings.context_len}" if settings.min_context_len in (None, settings.context_len)
              else f"drawn uniformly from {LENGTH_INTERVALS} evenly spaced values in [{settings.min_context_len}, "
                   f"{settings.context_len}]")
    init = "init 1" if settings.init_pattern is None else f"init the gates of pattern {settings.init_pattern}"
    loss = (f" + reg_weight {settings.reg_weight} x mean |alpha|" if target is None else
            f" only; in the forward pass each alpha is its hard value at sparsity {target:g} (1 for the gates the "
            "pattern's binarization keeps as retrieval, else 0) with a straight-through gradient to the soft gate, "
            "and no L1 term: the sparsity fixes the number of streaming heads; the gate gradients centered (summing "
            "to 0) and the gates unclamped, so that they rank the heads")
    clamp = ", gates clamped to [0, 1] after every step" if target is None else ""
    method = (
        f"DuoAttention gate optimization: {_GATE_KINDS[settings.layer_gates]} ({init}, broadcast over its GQA "
        "group), head output = alpha * causal attention + (1 - alpha) * streaming attention (Λ mask: sink "
        f"{settings.sink}, recent {settings.recent}); model frozen. Loss: mean over question/answer tokens of the "
        "squared distance (mean over the hidden size) between the final hidden states of the gated and the "
        f"full-attention model (distill){loss}. AdamW lr {settings.lr}, "
        "weight decay 0, reference trapezoid schedule (linear warmup over the first 20% of steps, linear decay over "
        f"the last 20%, both floored at 0.1x){clamp}; {settings.steps} steps, "
        f"{settings.batch_size} sample(s) per step and process x {result.world_size} process(es); data: "
        f"{settings.passkeys} 5-digit passkeys per prompt at random depths of varied filler sentences "
        f"(vllm_duo/tools/accuracy/passkey.py)"
        + (f", in {100 * settings.repeated:g}% of prompts one paragraph of {REPEATED_PERIOD[0]}-{REPEATED_PERIOD[1]} "
           "such sentences repeated" if settings.repeated else "")
        + f", prompt length {length} tokens, seed {settings.seed}; {result.dtype} on {result.device}"
        + (", gradient checkpointing" if settings.grad_checkpoint else ""))
    final = result.history[-1]
    last = result.history[-max(1, len(result.history) // 10):]
    figures = (f"final loss {final.loss:.6f} (distill {final.distill:.6f}, reg {final.reg:.6f}); mean loss of the "
               f"last {len(last)} steps {np.mean([s.loss for s in last]):.6f}; first-step loss "
               f"{result.history[0].loss:.6f}; {len(result.history)} steps in {result.wall_s:.1f} s wall; mean gate "
               f"{result.gates.mean():.4f}.")
    trained = None if target is None else HeadPattern._binarize(result.gates, target)
    if settings.init_pattern is not None:
        start = initial_pattern(settings, model_dir)
        changed = int((trained != HeadPattern._binarize(np.array(start.gates), target)).sum())
        note = (f'masks["{target}"]: trained by {SOURCE} --target-sparsity {target} '
                f"({date or datetime.date.today().isoformat()}): {method}. {figures} {changed} of {trained.size} heads "
                f"differ from the mask of the gates' ranking at {target}.")
        return with_trained_mask(start, target, trained, note)
    notes = (f"{figures} Trained with sink/recent {settings.sink}/{settings.recent}, deployed with "
             f"{deploy_sink}/{deploy_recent} (the paper trains 128/256 and deploys 64/256).")
    if sparsity is None:
        sparsity = 0.5 if target is None else target
    pattern = pattern_from_gates(result.gates, model_dir, name=name, aliases=aliases, sparsity=sparsity,
                                 sink=deploy_sink, recent=deploy_recent, source=SOURCE, method=method, notes=notes,
                                 date=date, license=license)
    return pattern if trained is None else with_trained_mask(pattern, target, trained)


def _worker(rank: int, world_size: int, model_dir: str, settings: IdentifySettings, out: str, run: dict,
            options: dict, port: int) -> None:
    """One spawned process of a multi-process run; rank 0 writes the pattern."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    _run_distributed(model_dir, settings, out, run, options)


def _write_if_complete(model_dir: str, settings: IdentifySettings, result: TrainResult, out: str,
                       options: dict) -> None:
    if len(result.history) == settings.steps:
        build_pattern(model_dir, settings, result, **options).save(out)


def _run_distributed(model_dir: str, settings: IdentifySettings, out: str, run: dict, options: dict) -> None:
    """Runs one process of a torch.distributed job (torchrun or spawn): data parallel over samples."""
    import torch.distributed as dist

    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cuda = _on_cuda(settings.device)
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    try:
        result = train(model_dir, settings, rank=rank, world_size=world_size, device=device, **run)
        if rank == 0:
            _write_if_complete(model_dir, settings, result, out, options)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def identify(model_dir: str | Path, out: str | Path, settings: IdentifySettings, *, processes: int | None = None,
             progress: bool = True, checkpoint: str | Path | None = None, time_limit: float | None = None,
             **options) -> str:
    """Trains the gates, writes the pattern JSON to `out` and returns a summary: the pattern as `pattern show` gives
    it (retrieval heads per layer at its default sparsity) and the training's figures.

    Under torchrun (WORLD_SIZE > 1) this process is one rank. Otherwise `processes` (default: the number of visible
    GPUs when training on CUDA, else 1) processes are spawned when it is above 1, each on its own GPU (gloo on CPU),
    data parallel over samples with the gate gradients all-reduced. `checkpoint` and `time_limit` are train()'s:
    a run stopped by the time limit writes no pattern, only the checkpoint. `options` go to build_pattern.
    """
    settings.check()
    model_dir, out = str(model_dir), str(out)
    if time_limit is not None and checkpoint is None:
        raise PatternError("a time limit needs a checkpoint (--checkpoint PATH): without one the stopped run's "
                           "training would be lost")
    run = {"checkpoint": None if checkpoint is None else str(checkpoint), "time_limit": time_limit}
    read_hf_config(model_dir)  # a wrong folder fails here, not in every spawned process
    if settings.init_pattern is not None:
        initial_pattern(settings, model_dir)  # so does a wrong initial pattern
    cuda = _on_cuda(settings.device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _run_distributed(model_dir, settings, out, run, options)
        if int(os.environ["RANK"]) != 0:
            return ""
    else:
        processes = processes or (torch.cuda.device_count() if cuda else 1)
        if processes > 1:
            import torch.multiprocessing as mp

            mp.spawn(_worker, args=(processes, model_dir, settings, out, run, options, free_port()),
                     nprocs=processes)
        else:
            _write_if_complete(model_dir, settings, train(model_dir, settings, progress=progress, **run), out,
                               options)
    if checkpoint is not None and (done := checkpoint_steps(checkpoint)) < settings.steps:
        return (f"stopped at step {done} of {settings.steps} (time limit); state saved in {checkpoint}: run the "
                "same command again to continue")
    return (f"wrote {out}\n{show(out, settings.target_sparsity)}\ntraining   "
            f"{HeadPattern.load(out).provenance.notes}")
