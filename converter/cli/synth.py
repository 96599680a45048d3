"""`kimi-convert synth`: a synthetic Kimi-K3-format source checkpoint (`..synth` writes it)."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.markup import escape

from ..contract import GROUP_SIZE
from ..errors import fatal
from ..output.directory import PERMISSION_ERRNOS, SPACE_ERRNOS
from ..reasons import Code
from ..text import plural
from .arguments import PathArg, seed_option
from .console import err, human, run_guarded


@click.command()
@click.argument("output", metavar="OUT_DIR", type=PathArg(path_type=Path))
@click.option(
    "--layers",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    metavar="N",
    help="Layers in all (num_hidden_layers); every fourth and the last have MLA attention, "
    "the others KDA.",
)
@click.option(
    "--dense-layers",
    default=None,
    type=click.IntRange(0),
    metavar="N",
    help="first_k_dense_replace: leading layers with a dense MLP and no experts "
    "[default: 1, or 0 with --layers 1].",
)
@click.option(
    "--moe-every",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    metavar="N",
    help="moe_layer_freq: after the dense prefix, layer i is a MoE layer when i % N == 0.",
)
@click.option(
    "--experts",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    metavar="N",
    help="Routed experts per MoE layer (num_experts).",
)
@click.option(
    "--top-k",
    default=2,
    show_default=True,
    type=click.IntRange(1),
    metavar="N",
    help="num_experts_per_token.",
)
@click.option(
    "--shards",
    default=None,
    type=click.IntRange(1),
    metavar="N",
    help="Pack the tensors by size into N shards, one expert's w1 and w3 split across two "
    "[default: one shard per layer plus three, as published; 3 with --coverage].",
)
@click.option(
    "--coverage",
    is_flag=True,
    help="The coverage layout instead of the published one: `mlp.` for every layer, a "
    "top-level quantization_config whose ignore list names every unquantized linear kind, "
    "shards packed by size.",
)
@click.option(
    "--routed-scaling-factor",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="X",
    help="routed_scaling_factor (the published value is 1.0; another value shows the "
    "scaling applied exactly once).",
)
@click.option(
    "--peak",
    default=0.0,
    type=click.FloatRange(0),
    metavar="S",
    help="Peaked logits: every RMSNorm weight 1 and lm_head drawn with std S/sqrt(hidden), so "
    "a logit has std ~S and greedy tokens follow the input (at 8 and the default 512-token "
    "vocabulary, such logits give a mean top-1 probability of about 0.73); 0 keeps every "
    "weight N(0, 0.02^2) [default: 0].",
)
@click.option(
    "--real-dims",
    is_flag=True,
    help="The published model's shapes: experts K 3584 x N 3072, hidden 7168, 96 KDA and "
    "96 MLA heads, dense MLP 33,792, two shared experts, a 27-block vision tower; the "
    "vocabulary stays small. Assumed where no public source states it: the processor "
    "files' names, config key order (docs/inventory.md, section 6).",
)
@click.option(
    "--k",
    "k",
    type=click.IntRange(32),
    default=None,
    metavar="N",
    help="routed_expert_hidden_size, a multiple of 32 [default: 256, 3584 with --real-dims]; "
    "the hidden size is twice it, as in the real model.",
)
@click.option(
    "--n",
    "n",
    type=click.IntRange(32),
    default=None,
    metavar="N",
    help="moe_intermediate_size, a multiple of 32 [default: 128, 3072 with --real-dims].",
)
@seed_option("the random weights", default=0)
def synth(
    output,
    layers,
    dense_layers,
    moe_every,
    experts,
    top_k,
    shards,
    coverage,
    routed_scaling_factor,
    peak,
    real_dims,
    k,
    n,
    seed,
) -> None:
    """Write a synthetic Kimi-K3-format source checkpoint to OUT_DIR (which must be empty
    or absent), random weights: every tensor SGLang's Kimi-K3 model class loads (KDA and
    MLA attention, dense MLPs, router, shared experts, latent projections, routed experts,
    norms, embeddings, lm_head, vision tower), under the names it loads them by, with only
    the routed experts quantized (MXFP4), as docs/inventory.md lists. The layout, dtypes,
    config and other files are the published checkpoint's (MoE layers `block_sparse_moe.`,
    quantization_config inside text_config, one shard per layer); --coverage writes the
    coverage layout. The default dims suit the SM90/SM120 MXFP4 MoE kernels on one GPU (K a
    multiple of 256, N of 128) and SGLang's Triton MLA decode (kv_lora_rank 256 + rope 32).

    Its dimensions are not the official model's, so convert it with
    --manifest kimi-k3-any (the default manifest pins the real dims).

    \b
    Examples:
      kimi-convert synth src/ && kimi-convert src/ out/ --manifest kimi-k3-any
      kimi-convert synth src/ --layers 4 --dense-layers 1 --experts 16 --k 256 --n 128
      kimi-convert synth big/ --real-dims --layers 2 --experts 28
    """
    from ..synth import cli_spec, synth_checkpoint

    def body() -> None:
        if output.exists() and (not output.is_dir() or any(output.iterdir())):
            raise fatal(Code.OUTPUT_NOT_EMPTY, rule="synth", file=output.resolve())
        spec = cli_spec(
            layers=layers,
            dense_layers=dense_layers,
            moe_every=moe_every,
            experts=experts,
            top_k=top_k,
            shards=shards,
            real_dims=real_dims,
            k=k,
            n=n,
            seed=seed,
            coverage=coverage,
            peak=peak,
            routed_scaling_factor=routed_scaling_factor,
        )
        kk, nn = spec.k, spec.n
        if kk % GROUP_SIZE or nn % GROUP_SIZE:
            raise fatal(Code.USAGE, rule="synth-group", group=GROUP_SIZE)
        if not spec.moe_layers():
            raise fatal(Code.USAGE, rule="synth-no-moe")
        started = time.perf_counter()
        try:
            info = synth_checkpoint(output, spec)
        except OSError as exc:  # a folder it may not write, a full disk: coded, no traceback
            raise _os_refusal(exc, output) from None
        err.print(
            f"wrote {escape(str(output.resolve()))}: {plural(info['tensors'], 'tensor')} in "
            f"{plural(info['shards'], 'shard')}, {human(info['bytes'])} in "
            f"{time.perf_counter() - started:.1f} s (K={kk}, N={nn}, "
            f"{plural(experts, 'expert')} x {plural(len(spec.moe_layers()), 'MoE layer')} of "
            f"{layers}); convert it with "
            "--manifest kimi-k3-any"
        )

    run_guarded(body)


def _os_refusal(exc: OSError, where: Path) -> Exception:
    """An OS error writing `where` as a coded problem naming the file it hit."""
    file = exc.filename if exc.filename is not None else where
    if exc.errno in PERMISSION_ERRNOS:
        return fatal(Code.PERMISSION_DENIED, rule="folder", file=file)
    if exc.errno in SPACE_ERRNOS:
        return fatal(Code.NO_SPACE, rule="device", file=file, error=exc.strerror or exc)
    return fatal(Code.IO_ERROR, file=file, error=exc.strerror or exc)
