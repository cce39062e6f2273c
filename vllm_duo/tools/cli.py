# SPDX-License-Identifier: Apache-2.0
"""The `vllm-duo` command line: argument parsing and dispatch; each command's logic lives in its own module."""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from vllm_duo.kernels import fp8
from vllm_duo.pattern import PatternError, resolve_pattern
from vllm_duo.tools import cache_sim, pattern_commands, zigzag
from vllm_duo.tools.accuracy.eval_report import WeakReference
from vllm_duo.tools.bench.command import command as run_bench
from vllm_duo.tools.bench.report import FailedRuns
from vllm_duo.tools.bench.workloads import WORKLOADS, BenchError
from vllm_duo.tools.processes import CPU_KV_CACHE_GIB

# A command is a function that adds its parser to the `vllm-duo` subparsers and sets `handler`: a function of the
# parsed arguments returning the text to print. To add one, write such a function and list it in _COMMANDS.
_Subparsers = argparse._SubParsersAction


def _add_pattern_file_args(parser: argparse.ArgumentParser, date_default: str = "today",
                           license_help: str = "license of the model, e.g. Apache-2.0") -> None:
    """Options of the commands that write a pattern JSON: its model names and provenance."""
    parser.add_argument("--name", help="model name (default: the folder name)")
    parser.add_argument("--alias", action="append", default=[], dest="aliases", metavar="NAME",
                        help="another name that finds this pattern, e.g. a Hugging Face repo id (repeatable)")
    parser.add_argument("--date", help=f"provenance date, YYYY-MM-DD (default: {date_default})")
    parser.add_argument("--license", help=license_help)


def _add_pattern_commands(commands: _Subparsers) -> None:
    pattern = commands.add_parser("pattern", help="convert, inspect and check head-pattern files",
                                  description="Convert, inspect and check DuoAttention head-pattern files.")
    actions = pattern.add_subparsers(dest="action", required=True, metavar="ACTION")
    pattern_help = "a pattern JSON file, a bundled pattern name or alias, or a duo-attention reference folder"

    convert = actions.add_parser(
        "convert", help="convert a duo-attention reference folder to a pattern JSON",
        description="Convert a mit-han-lab/duo-attention attn_patterns run folder (full_attention_heads.tsv + "
                    "config.json) to a vllm-duo pattern JSON, keeping the gates.")
    convert.add_argument("reference_dir", metavar="REFERENCE_DIR")
    convert.add_argument("-o", "--output", required=True, metavar="OUT.json")
    convert.add_argument("--model", metavar="MODEL_DIR", help="model folder whose config.json gives the shape")
    convert.add_argument("--architecture", help="e.g. LlamaForCausalLM (overrides --model)")
    convert.add_argument("--head-dim", type=int, help="attention head size (overrides --model)")
    convert.add_argument("--sink", type=int, default=64, help="sink tokens of streaming heads (default 64)")
    convert.add_argument("--recent", type=int, default=256, help="recent tokens of streaming heads (default 256)")
    convert.add_argument("--sparsity", type=float, default=0.5, help="default fraction of streaming heads (0.5)")
    convert.add_argument("--source", help="provenance source (default: the training run's output_dir)")
    _add_pattern_file_args(convert, "the TSV's modification date", "license of the gates, e.g. MIT")
    convert.set_defaults(handler=lambda args: pattern_commands.convert(
        args.reference_dir, args.output, name=args.name, aliases=args.aliases, model_config=args.model,
        architecture=args.architecture, head_dim=args.head_dim, sink=args.sink, recent=args.recent,
        sparsity=args.sparsity, source=args.source, date=args.date, license=args.license))

    show = actions.add_parser("show", help="per-layer retrieval heads and KV saving of a pattern",
                              description="Print per-layer retrieval counts, the retrieval ratio, sink/recent and "
                                          "the expected KV-cache saving; optionally draw a heatmap.")
    show.add_argument("pattern", metavar="PATTERN", help=pattern_help)
    show.add_argument("--sparsity", type=float, help="fraction of streaming heads (default: the pattern's)")
    show.add_argument("--context-len", type=int, default=32768, help="tokens per sequence (default 32768)")
    show.add_argument("--heatmap", metavar="OUT.png", help="write a PNG of the gates with retrieval heads marked")
    show.set_defaults(handler=lambda args: pattern_commands.show(args.pattern, args.sparsity, args.context_len,
                                                               args.heatmap))

    validate = actions.add_parser("validate", help="check a pattern file (and that it fits a model)",
                                  description="Validate a pattern; with --model, check its shape against the "
                                              "model's config.json.")
    validate.add_argument("pattern", metavar="PATTERN", help=pattern_help)
    validate.add_argument("--model", metavar="MODEL_DIR", help="Hugging Face model folder with config.json")
    validate.set_defaults(handler=lambda args: pattern_commands.validate(args.pattern, args.model))

    layers = actions.add_parser(
        "zigzag", help="make a layer-exclusive (ZigzagAttention) pattern: each layer all-retrieval or all-streaming",
        description="Choose round(s x L) streaming layers by the ZigzagAttention transport cost from the head-level "
                    "mask at sparsity s (a retrieval head turned streaming costs its gate, a streaming head turned "
                    "retrieval omega x its gate) and write the pattern with that mask, keeping the gates.")
    layers.add_argument("pattern", metavar="PATTERN", help=pattern_help + " (with gates)")
    layers.add_argument("--sparsity", type=float, required=True, help="fraction of streaming layers, e.g. 0.5")
    layers.add_argument("--omega", type=float, default=zigzag.DEFAULT_OMEGA,
                        help="cost weight of turning a streaming head into retrieval (default 0.1)")
    layers.add_argument("-o", "--output", required=True, metavar="OUT.json")
    layers.set_defaults(handler=lambda args: zigzag.write_zigzag(args.pattern, args.output, args.sparsity,
                                                                 args.omega))

    average = actions.add_parser(
        "average", help="average the gates of several identify runs (e.g. seeds) into one pattern",
        description="Write a pattern whose gates are the mean of the inputs' gates. The inputs must be of one "
                    "model shape and share sparsity, sink and recent, which the output keeps.")
    average.add_argument("patterns", nargs="+", metavar="PATTERN", help=pattern_help + " (with gates)")
    average.add_argument("-o", "--output", required=True, metavar="OUT.json")
    average.add_argument("--name", help="model name (default: the first input's)")
    average.set_defaults(handler=lambda args: pattern_commands.average(args.patterns, args.output, args.name))

    score = actions.add_parser(
        "score", help="score a model's KV heads on passkey prompts and write a pattern JSON",
        description="Run a Hugging Face model on CPU over synthetic passkey prompts and write a pattern whose gates "
                    "are each KV head's attention on the passkey outside the sink + recent window, divided by the "
                    "largest; a first pattern without training.")
    score.add_argument("--model", required=True, metavar="MODEL_DIR", help="Hugging Face model folder")
    score.add_argument("-o", "--output", required=True, metavar="OUT.json")
    score.add_argument("--samples", type=int, default=16, help="passkey prompts to average over (default 16)")
    score.add_argument("--context-len", type=int, default=2048, help="tokens per prompt (default 2048)")
    score.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    score.add_argument("--sink", type=int, default=64, help="sink tokens of streaming heads (default 64)")
    score.add_argument("--recent", type=int, default=256, help="recent tokens of streaming heads (default 256)")
    score.add_argument("--sparsity", type=float, default=0.5, help="default fraction of streaming heads (0.5)")
    _add_pattern_file_args(score)
    score.set_defaults(handler=_score)


def _score(args: argparse.Namespace) -> str:
    # imported here: it loads torch and transformers, which no other command needs
    from vllm_duo.tools.accuracy import scoring

    return scoring.write_scored_pattern(
        args.model, args.output, name=args.name, aliases=args.aliases, num_samples=args.samples,
        context_len=args.context_len, seed=args.seed, sink=args.sink, recent=args.recent, sparsity=args.sparsity,
        date=args.date, license=args.license)


def _add_bench_command(commands: _Subparsers) -> None:
    parser = commands.add_parser(
        "bench", help="vLLM's own benchmarks, dense vs duo side by side, into results.json and results.md",
        description="Run vLLM's `bench throughput`, `bench latency` and `bench serve` (against a server started "
                    "here) for vLLM's default dense backend and for duo at each sparsity, same model, settings and "
                    "machine, one subprocess per run with its log kept; write results.json, results.md (tables "
                    "with duo/dense ratios and a physical-limit column) and plots. `all` = every workload but the "
                    "tiny CPU checks.",
        epilog="workloads: " + "; ".join(f"{name}: {w.describe()}" for name, w in WORKLOADS.items()))
    parser.add_argument("--model", help="model folder or id (default for the tiny workloads: the bundled "
                                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", help="tokenizer folder or id (default: the model's)")
    parser.add_argument("--load-format", default="dummy",
                        help="vLLM --load-format (default dummy: random weights, real shapes)")
    parser.add_argument("--pattern", help="duo head pattern: a file, bundled name or reference folder "
                                          "(default: found by the model's name)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5, 0.75], metavar="S",
                        help="duo sparsities to run (default 0.25 0.5 0.75)")
    parser.add_argument("--capacity-sparsity", type=float, nargs="+", metavar="S",
                        help="sparsities of the capacity and ceiling workloads only (default: --sparsity); their "
                             "runs only start vLLM, so sweep here")
    parser.add_argument("--zigzag-sparsity", type=float, nargs="+", default=[], metavar="S",
                        help="also run duo with the pattern's layer-exclusive (ZigzagAttention) form at these "
                             "sparsities, written to OUT/patterns/ (not in the capacity and ceiling workloads)")
    parser.add_argument("--squeeze", type=float, nargs="+", default=[], metavar="BUDGET",
                        help="also run duo with Squeezed Attention (duo.squeeze) reading these shares of each "
                             "prompt's clustered keys at decode, at each --sparsity (not in the capacity and ceiling "
                             "workloads)")
    parser.add_argument("--squeeze-keys-per-cluster", type=int, metavar="N",
                        help="keys per centroid of the --squeeze runs (default: duo.squeeze's, 16)")
    parser.add_argument("--sink", type=int, default=64, help="duo sink tokens (default 64)")
    parser.add_argument("--recent", type=int, default=256, help="duo recent tokens (default 256)")
    parser.add_argument("--workloads", nargs="+", default=["all"], metavar="NAME",
                        help=f"workloads to run (default all): {', '.join(WORKLOADS)}")
    parser.add_argument("--max-model-len", nargs="+", default=[], metavar="NAME=N",
                        help="max_model_len of a workload, e.g. decode_heavy=20000")
    parser.add_argument("--set", nargs="+", default=[], metavar="NAME.FIELD=VALUE",
                        help="change a workload field, e.g. decode_heavy.num_prompts=64 "
                             "serve_16k.request_rates=1,2,4 tpot_64k.num_iters=3")
    parser.add_argument("--extra-dense-backends", nargs="*", default=[], metavar="BACKEND",
                        help="more dense baselines by vLLM --attention-backend name, e.g. FLASHINFER (skipped, "
                             "with the reason, when not importable)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], metavar="DTYPE",
                        choices=["auto", "bfloat16", "float16", *fp8.KV_CACHE_DTYPES],
                        help="KV cache dtypes: every backend runs at each, and each run's ratio is against dense at "
                             "the same dtype, e.g. 'auto fp8' (default auto: the model's dtype)")
    parser.add_argument("--engine-args", metavar="'ARGS'",
                        help="more vLLM engine arguments for every run, dense and duo alike, e.g. "
                             "'--gpu-memory-utilization 0.9'")
    parser.add_argument("--only", choices=["dense", "duo", "zigzag", "squeeze"],
                        help="run only the dense baselines, only head-level duo or only the zigzag runs: one part "
                             "of a suite split over several calls of one machine into the same --out, where the "
                             "parts meet in one report")
    parser.add_argument("--side-by-side", action="store_true",
                        help="serve workloads: every backend's server up at once (each with an equal share of the "
                             "GPU's memory unless --engine-args sizes it), their clients in turn, in the opposite "
                             "order at every other run of a repeated point, so that a drift over the runs falls on "
                             "every backend alike")
    parser.add_argument("--out", metavar="DIR",
                        help="results folder (default benchmarks/results/<timestamp>-<device>); into a folder "
                             "with a results.json the new runs are added, the same runs replaced")
    parser.add_argument("--kv-cache-space", type=int, default=CPU_KV_CACHE_GIB, metavar="GIB",
                        help="CPU stack only: each vLLM engine's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, which wins "
                             f"when set; default {CPU_KV_CACHE_GIB})")
    parser.add_argument("--timeout", type=float, default=900, metavar="SECONDS",
                        help="limit per run, a server's start included (default 900)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild results.md and plots from the results in --out and --merge")
    parser.add_argument("--merge", nargs="+", default=[], metavar="DIR",
                        help="add the runs of other results folders, e.g. parts of one suite run in several calls")
    parser.set_defaults(handler=run_bench)


def _add_identify_command(commands: _Subparsers) -> None:
    parser = commands.add_parser(
        "identify", help="train DuoAttention gates on passkey prompts and write a pattern JSON",
        description="Train one gate per layer and KV head (the model frozen) so that alpha * full + (1 - alpha) * "
                    "streaming attention keeps the final hidden states of the full model on synthetic multi-passkey "
                    "prompts, with an L1 pull of the gates toward 0; write the trained gates as a pattern JSON. "
                    "With --target-sparsity S, train the mask served at S instead (straight-through hard gates, no "
                    "L1) and store it in the pattern as masks[S], which serving at S then uses. "
                    "Uses every visible GPU (data parallel, torch.distributed); also runs under torchrun.")
    parser.add_argument("--model", required=True, metavar="MODEL_DIR", help="Hugging Face model folder")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.json")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000, the reference's)")
    parser.add_argument("--context-len", type=int,
                        help="longest prompt in tokens (default: the model's max_position_embeddings, at most "
                             "32000, on GPU; 2048 on CPU)")
    parser.add_argument("--min-context-len", type=int,
                        help="shortest prompt; lengths are drawn from 50 evenly spaced values in [min, max] "
                             "(default: 1000 on GPU, as the paper; half of --context-len on CPU)")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per step and process (default 1)")
    parser.add_argument("--lr", type=float, default=0.02, help="peak AdamW learning rate (default 0.02)")
    parser.add_argument("--reg-weight", type=float, default=0.05, help="weight of the L1 gate term (default 0.05)")
    parser.add_argument("--sink", type=int,
                        help="sink tokens of the training Λ mask (default: --init-pattern's, else 64, the deployed "
                             "sink)")
    parser.add_argument("--recent", type=int,
                        help="recent tokens of the training Λ mask (default: --init-pattern's, else 256)")
    parser.add_argument("--passkeys", type=int, default=10, help="passkeys per prompt (default 10)")
    parser.add_argument("--repeated-haystack", type=float, default=0.0, dest="repeated", metavar="SHARE",
                        help="share of prompts whose haystack is one short paragraph repeated, as in the classic "
                             "passkey test (default 0)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the prompts (default 42)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="model dtype (default bfloat16 on GPU, float32 on CPU); the gates stay float32")
    parser.add_argument("--grad-checkpoint", action="store_true",
                        help="recompute each layer in the backward pass (for long contexts or large models)")
    parser.add_argument("--layer-gates", action="store_true",
                        help="train one gate per layer (ZigzagAttention); make the layer-exclusive pattern from it "
                             "with `vllm-duo pattern zigzag`")
    parser.add_argument("--target-sparsity", type=float, metavar="S",
                        help="train the mask served at sparsity S: in the forward pass each gate is its hard value "
                             "at S (1 for the heads the binarization keeps, else 0) with a straight-through "
                             "gradient, no L1 term; the pattern stores the trained mask as masks[S]")
    parser.add_argument("--init-pattern", metavar="PATTERN",
                        help="with --target-sparsity: start from this pattern's gates (a file or bundled name) and "
                             "write it with masks[S] added and the run in its notes (its gates, names, sparsity, "
                             "sink/recent and license kept)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="continue from this training-state file when it exists; save to it every "
                             "50 steps and when stopping")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop training after this many seconds, state saved to --checkpoint, and write no "
                             "pattern yet: for machines that limit a command's time (run again to continue)")
    parser.add_argument("--processes", type=int,
                        help="data-parallel processes to spawn (default: the visible GPUs on CUDA, 1 on CPU)")
    parser.add_argument("--sparsity", type=float,
                        help="the pattern's default sparsity (default: --target-sparsity, else 0.5)")
    parser.add_argument("--deploy-sink", type=int, help="the pattern's serving sink (default: --sink)")
    parser.add_argument("--deploy-recent", type=int, help="the pattern's serving recent (default: --recent)")
    _add_pattern_file_args(parser)
    parser.set_defaults(handler=_identify)


def _identify(args: argparse.Namespace) -> str:
    from vllm_duo.tools.accuracy import identify, training  # imported here: torch and transformers load slowly

    context_len = args.context_len or identify.default_context_len(args.model, args.device)
    # a fine-tuned mask is trained for the window its pattern serves
    window = resolve_pattern(args.init_pattern)[0] if args.init_pattern else training.IdentifySettings()
    sink = window.sink if args.sink is None else args.sink
    recent = window.recent if args.recent is None else args.recent
    settings = training.IdentifySettings(
        steps=args.steps, context_len=context_len, min_context_len=args.min_context_len
        or identify.default_min_context_len(context_len, args.device, sink, recent),
        batch_size=args.batch_size, lr=args.lr, reg_weight=args.reg_weight, sink=sink, recent=recent,
        passkeys=args.passkeys, repeated=args.repeated, seed=args.seed, dtype=args.dtype,
        grad_checkpoint=args.grad_checkpoint, layer_gates=args.layer_gates, target_sparsity=args.target_sparsity,
        init_pattern=args.init_pattern, device=args.device)
    return identify.identify(
        args.model, args.output, settings, processes=args.processes, checkpoint=args.checkpoint,
        time_limit=args.time_limit, name=args.name, aliases=args.aliases,
        sparsity=args.sparsity, deploy_sink=args.deploy_sink, deploy_recent=args.deploy_recent, date=args.date,
        license=args.license)


def _add_eval_command(commands: _Subparsers) -> None:
    from vllm_duo.tools.accuracy.evaluate import (CPU_CONTEXTS, CPU_PASSKEY_REPEATS, CPU_SAMPLES, DEFAULT_CONTEXTS,
                                                  DEFAULT_DEPTHS, DEFAULT_METHODS, DEFAULT_PASSKEY_REPEATS,
                                                  DEFAULT_SAMPLES, FAMILIES)
    from vllm_duo.tools.accuracy.needles import DEFAULT_NEEDLES, HAYSTACKS, NEEDLES, TEMPLATES

    parser = commands.add_parser(
        "eval", help="needle-in-a-haystack accuracy through vLLM: dense, duo, zigzag, random heads, StreamingLLM",
        description="Greedy recall of a 5-digit key through in-process vLLM engines, for each method on the same "
                    "prompts, in two families: needles (several needle phrasings and haystack styles over a grid of "
                    "context lengths x needle depths) and passkey (the classic passkey test: one key in a repeated "
                    "paragraph, over repeat counts x depths); writes results.json, results.md (accuracy, paired 95% "
                    "intervals against full attention overall and per length) and accuracy heatmaps. Exits with code "
                    "3 when a full-attention method answers under 90% of a family's prompts: such an eval cannot see "
                    "a loss there. Methods: full (vLLM's dense backend), duoXX (the pattern at sparsity XX%), zigzagXX "
                    "(its layer-exclusive form), randomXX (random gates, same sparsity), streamingXX (all heads "
                    "streaming at the KV budget of duoXX); -fp8 / -fp8calc: an fp8 KV cache with scales 1.0 / "
                    "calculated by vLLM (compared with full-fp8 when it runs), -sqNN: duo with Squeezed Attention "
                    "reading NN% of each prompt's clustered keys at decode, -rN: duo's recent window N.")
    parser.add_argument("--model", metavar="MODEL_DIR", help="Hugging Face model folder (default: the bundled "
                                                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--pattern", help="duo head pattern: a file, bundled name or reference folder (default: "
                                          "found by the model's name)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
                        help=f"default: {' '.join(DEFAULT_METHODS)}")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), metavar="FAMILY",
                        help=f"prompt families of {', '.join(FAMILIES)} (default: both)")
    cpu_grid = "on a CPU with neither --contexts nor --samples"
    parser.add_argument("--contexts", nargs="+", type=int, metavar="TOKENS",
                        help=f"needles: prompt lengths (default: {' '.join(map(str, DEFAULT_CONTEXTS))}; {cpu_grid}: "
                             f"{' '.join(map(str, CPU_CONTEXTS))})")
    parser.add_argument("--passkey-repeats", nargs="+", type=int, metavar="N",
                        help="passkey: repeats of the filler paragraph, about 24 tokens each on SmolLM2 (default: "
                             f"{' '.join(map(str, DEFAULT_PASSKEY_REPEATS))}; {cpu_grid}: "
                             f"{' '.join(map(str, CPU_PASSKEY_REPEATS))})")
    parser.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS), metavar="D",
                        help="needle depths in [0, 1]; needles: among the places outside the streaming view of the "
                             "question; passkey: each prompt draws its depth between the smallest and largest, and "
                             "the needle follows int(repeats x depth) paragraphs (default: "
                             f"{' '.join(f'{d:g}' for d in DEFAULT_DEPTHS)})")
    parser.add_argument("--samples", type=int,
                        help=f"prompts per (context, depth) cell; passkey: depths x samples prompts per repeat count "
                             f"(default {DEFAULT_SAMPLES}; {cpu_grid}: {CPU_SAMPLES})")
    parser.add_argument("--template", choices=TEMPLATES, default="plain",
                        help="plain: text only, the question and the answer's first words on one line; chat: a user "
                             "turn of the model's chat template, the answer's first words in the assistant's "
                             "(default plain: SmolLM2 recalls far less in chat form)")
    parser.add_argument("--ask-first", action="store_true",
                        help="the intro already asks the question (default: it only says a fact is hidden)")
    parser.add_argument("--needles", nargs="+", default=list(DEFAULT_NEEDLES), choices=NEEDLES, metavar="NAME",
                        help=f"needle phrasings of {', '.join(NEEDLES)}, taken in turn (default: "
                             f"{' '.join(DEFAULT_NEEDLES)})")
    parser.add_argument("--haystacks", nargs="+", default=list(HAYSTACKS), choices=HAYSTACKS, metavar="NAME",
                        help=f"haystack styles, taken in turn (default: {' '.join(HAYSTACKS)})")
    parser.add_argument("--sink", type=int, help="duo sink tokens (default: the pattern's)")
    parser.add_argument("--recent", type=int, help="duo recent tokens (default: the pattern's)")
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per answer (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the random pattern (default 0)")
    parser.add_argument("--dtype", help="vLLM dtype (default float32 on CPU, auto on GPU)")
    parser.add_argument("--kv-cache-space", type=int, default=CPU_KV_CACHE_GIB, metavar="GIB",
                        help="CPU stack only: each vLLM engine's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, which wins "
                             f"when set; default {CPU_KV_CACHE_GIB})")
    parser.add_argument("--engine-args", metavar="JSON", help="more vLLM LLM(...) arguments as a JSON object")
    parser.add_argument("--side-by-side", action="store_true",
                        help="serve workloads: every backend's server up at once (each with an equal share of the "
                             "GPU's memory unless --engine-args sizes it), their clients in turn, in the opposite "
                             "order at every other run of a repeated point, so that a drift over the runs falls on "
                             "every backend alike")
    parser.add_argument("--out", metavar="DIR",
                        help="results folder (default benchmarks/results/eval-<model>-<cpu|gpu>-<date>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rewrite results.md and the heatmaps of the results.json in --out")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> str:
    from vllm_duo.tools.accuracy import evaluate  # imported here: vLLM loads slowly

    return evaluate.command(args)


_TRACE_OPTIONS = (  # the fields of cache_sim.Trace that `vllm-duo cache-sim` takes, each an --option of its name
    ("documents", "shared documents"),
    ("document_len", "tokens per document"),
    ("question_len", "tokens per question"),
    ("question_len_max", "draw question lengths uniformly from --question-len up to this; 0: no draw"),
    ("output_len", "tokens per answer"),
    ("requests", "questions, spread evenly over the documents and shuffled"),
    ("system_len", "tokens of a system prompt before every document"),
    ("turns", "turns per request, each resending the conversation with a new question"),
    ("arrivals_per_step", "requests sent per scheduler step; 0: all at once"),
    ("seed", "seed of the tokens and their order"),
)


def _add_cache_sim_command(commands: _Subparsers) -> None:
    trace, engine, duo = cache_sim.ISSUE_TRACE, cache_sim.ISSUE_ENGINE, cache_sim.DUO
    parser = commands.add_parser(
        "cache-sim", help="prefix caching under a full KV cache, dense vs duo, in vLLM's scheduler without a model",
        description="Replay questions over shared documents through vLLM's own scheduler and KV cache manager, "
                    "without a model (seconds on a CPU), for dense and duo at equal KV bytes, the Llama-3.1-8B "
                    "shape; print hit rate, prompt tokens computed and computed again, steps, requests running and "
                    "waiting, preemptions and cached pages no hit can reach. Defaults: the trace of the "
                    f"shared_docs_full benchmark ({trace.describe()}) on an H100's fp8 cache.")
    trace_args = parser.add_argument_group("trace")
    for name, meaning in _TRACE_OPTIONS:
        trace_args.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(trace, name),
                                help=f"{meaning} (default %(default)s)")
    engine_args = parser.add_argument_group("engine")
    engine_args.add_argument("--dense-kv-tokens", type=int, default=engine.dense_kv_tokens,
                             help="KV cache bytes, given as dense's token capacity (default %(default)s: an H100's "
                                  "dense fp8 cache for Llama-3.1-8B)")
    engine_args.add_argument("--kv-cache-dtype", default=engine.kv_dtype, metavar="|".join(cache_sim.KV_DTYPES),
                             help="KV cache dtype (default %(default)s)")
    engine_args.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens,
                             help="tokens per scheduler step (default %(default)s)")
    engine_args.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs,
                             help="requests running at most (default %(default)s)")
    engine_args.add_argument("--no-async-scheduling", action="store_true",
                             help="schedule a step once the last one's output is in (default: one step ahead)")
    duo_args = parser.add_argument_group("duo")
    duo_args.add_argument("--pattern", default=duo["pattern"],
                          help="head pattern for the Llama-3.1-8B shape (default %(default)s)")
    duo_args.add_argument("--sparsity", type=float, default=duo["sparsity"],
                          help="fraction of streaming heads (default %(default)s)")
    duo_args.add_argument("--sink", type=int, default=duo["sink"], help="sink tokens (default %(default)s)")
    duo_args.add_argument("--recent", type=int, default=duo["recent"], help="recent tokens (default %(default)s)")
    parser.add_argument("--backends", nargs="+", default=list(cache_sim.BACKENDS), metavar="BACKEND",
                        help=f"backends to replay (default: {' '.join(cache_sim.BACKENDS)})")
    parser.add_argument("--json", metavar="OUT.json", help="write the replays, the trace and the engine")
    parser.set_defaults(handler=_cache_sim)


def _cache_sim(args: argparse.Namespace) -> str:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM logs to stdout, where the table goes
    trace = cache_sim.Trace("cache-sim", **{name: getattr(args, name) for name, _ in _TRACE_OPTIONS})
    engine = cache_sim.Engine(args.dense_kv_tokens, args.kv_cache_dtype,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                              async_scheduling=not args.no_async_scheduling,
                              duo={name: getattr(args, name) for name in cache_sim.DUO})
    return cache_sim.compare(trace, engine, args.backends, args.json)


_COMMANDS: tuple[Callable[[_Subparsers], None], ...] = (_add_pattern_commands, _add_bench_command,
                                                         _add_identify_command, _add_eval_command,
                                                         _add_cache_sim_command)


EXIT_CODES = ("exit codes: 0 done; 1 a run failed (the last line says so); 2 a user error (one line); 3 an eval whose "
              "full attention answered under 90% of a family's prompts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-duo", description="DuoAttention for vLLM: tools around the plugin.",
                                     epilog=EXIT_CODES)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in _COMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command and returns its exit code:

    0: done. 1: a run failed. A bench with a failed run prints its summary, whose last line counts the failed runs
    ("4 runs, 4 failed; results: ..."); any other failure prints Python's traceback and then one line
    `vllm-duo COMMAND: failed: ...`. 2: a user error, one `vllm-duo: error: ...` line on stderr. 3: an eval whose full
    attention answers under 90% of its prompts prints its summary and a warning."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        output = args.handler(args)
    except WeakReference as error:  # the eval ran, but its numbers cannot show a loss: printed, and exit code 3
        print(error)
        return 3
    except FailedRuns as error:  # the summary, its last line counting the failed runs
        print(error)
        return 1
    except (PatternError, BenchError, cache_sim.CacheSimError) as error:
        parser.exit(2, f"vllm-duo: error: {error}\n")
    except OSError as error:
        problem = f"{error.strerror}: {error.filename}" if error.filename else str(error)
        parser.exit(2, f"vllm-duo: error: {problem}\n")
    except Exception as error:  # a failed run: the traceback, then the line that says so
        traceback.print_exc()
        first_line = next(iter(str(error).splitlines()), "")
        print(f"vllm-duo {args.command}: failed: {type(error).__name__}: {first_line}", file=sys.stderr)
        return 1
    if output:
        print(output)
    return 0


if __name__ == "__main__":  # `python -m vllm_duo.tools.cli` from a source checkout, where the console script is absent
    sys.exit(main())
