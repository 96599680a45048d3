"""The adapter outside `serve`'s command line: building its kernels (`prebuild`), the
installed FlashInfer's SiTU support, loading a checkpoint in SGLang's processes, and the
smoke request against a running server. Their exception classes stay in the adapter (code
catches them by type); their words and codes are these records."""

from __future__ import annotations

from ...converter.errors import Message, Reason

_SERVE_MARLIN = "or serve with --moe-runner-backend marlin."
_MARLIN_INSTEAD = "serve with --moe-runner-backend marlin instead"

REASONS = (
    # -- prebuild ---------------------------------------------------------------------------
    Reason(
        "no-cuda-toolkit",
        "the CUDA toolkit at {home} lacks {missing}",
        hint="install the full CUDA toolkit (nvcc and the cuRAND development headers, e.g. the "
        "distribution's cuda-toolkit or libcurand-dev package) and set CUDA_HOME to it, or "
        "build on a machine that has it (`prebuild --arch sm90 --out DIR` needs no GPU)",
    ),
    Reason("no-torch", "prebuild needs torch and FlashInfer", hint="{install}"),
    Reason(
        "prebuild-arch",
        rules={
            "unknown": Message("unknown arch {arch!r}: expected one of {arches}"),
            "other-gpu": Message(
                "this machine's GPU is {gpu}, not {arch}: prebuild on the GPU you serve on, "
                "or on a machine without a GPU"
            ),
            "unsupported-gpu": Message("{error}"),
            "precision": Message(
                "precision {precision} is not a {arch} module: expected {expected_keys}"
            ),
        },
    ),
    Reason(
        "prebuild-flashinfer-imported",
        "flashinfer was imported in this process before prebuild, on a machine without a "
        "GPU: its cache directory would not be the server's",
        hint="run prebuild in a fresh process, or set FLASHINFER_CUDA_ARCH_LIST={arch_list}",
    ),
    Reason(
        "prebuild-build",
        rules={
            "recipe": Message("cannot compute the {variant} module's recipe: {error}"),
            "compile": Message("building {module} failed: {error}"),
            "folder": Message("cannot make the bundle folder {out}: {error}"),
            "write": Message("cannot write the bundle at {out}: {error}"),
        },
    ),
    # -- the installed FlashInfer -----------------------------------------------------------
    Reason(
        "situ-unsupported",
        rules={
            "not-installed": Message(
                "cannot import flashinfer: FlashInfer is not installed. Kimi-K3 SiTU on the "
                "FlashInfer CUTLASS MoE needs flashinfer-python >= 0.7.0",
                hint="install the serving extras from the repository clone: {install}, "
                + _SERVE_MARLIN,
            ),
            "broken": Message(
                "cannot import flashinfer.fused_moe ({error!r}): the installed FlashInfer is "
                "broken or incomplete",
                hint="reinstall it ({install} from the repository clone), " + _SERVE_MARLIN,
            ),
            "missing": Message(
                "flashinfer-python {version} cannot run Kimi-K3's SiTU activation in its "
                "CUTLASS fused MoE: missing {missing}",
                hint="upgrade flashinfer-python (>= 0.7.0 has CUTLASS SiTU), " + _SERVE_MARLIN,
            ),
            "humming": Message(
                "flashinfer-python {version} cannot run SM90 W4A8 (--flashinfer-mxfp4-moe-"
                "precision fp8): missing {missing}",
                hint="use the default precision (W4A16), or upgrade flashinfer-python "
                "(0.7.2.post1 has it)",
            ),
        },
    ),
    # -- loading a checkpoint in SGLang -----------------------------------------------------
    Reason(
        "unsupported-combination",
        rules={
            "a2a": Message(
                "{where}: --moe-a2a-backend {a2a} is not supported by the kimi_w31 SiTU "
                "CUTLASS method (it runs with the standard dispatcher only)",
                hint="drop --moe-a2a-backend, or " + _MARLIN_INSTEAD,
            ),
            "paged-experts": Message(
                "{where}: --enable-paged-experts is not supported",
                hint="drop it, or " + _MARLIN_INSTEAD,
            ),
            "ktransformers": Message(
                "{where}: KTransformers CPU/GPU expert offload (--kt-weight-path) is not supported",
                hint="drop it, or " + _MARLIN_INSTEAD,
            ),
            "ar-fusion": Message(
                "{where}: SGLANG_K3_AR_FUSION=1 defers the MoE finalize, which only the SM100 "
                "trtllm-gen kernel supports",
                hint="unset SGLANG_K3_AR_FUSION",
            ),
        },
    ),
    Reason(
        "w31-unsplittable",
        rules={
            "grammar": Message(
                "a fused w31 tensor outside the checkpoint grammar "
                "(experts.<id>.w31.<weight_packed|weight_scale>)",
                hint="the checkpoint was not written by kimi-convert or was edited (run "
                "`kimi-convert verify`)",
            ),
            "shape": Message(
                "a w31 tensor must be 2-D with an even, non-zero row count "
                "([up; gate] = [2N, ...])",
                found="shape {shape}",
                hint="the checkpoint is damaged or was not written by kimi-convert (run "
                "`kimi-convert verify`)",
            ),
        },
    ),
    Reason(
        "opt-in-value",
        "{env}={value!r}: expected 1/true/yes/on or 0/false/no/off",
    ),
    # -- the smoke request ------------------------------------------------------------------
    Reason("server-exited", "the server process exited before it was ready"),
    Reason("not-ready", "{url}/health did not answer 200 within {timeout:.0f} s"),
    Reason("bad-stream", "not JSON in the stream: {payload!r}"),
    Reason("server-error", "the server answered: {error}"),
    Reason("http-error", "{url}/generate answered HTTP {status}"),
    Reason("unreachable", "{url}/generate: {error}"),
    Reason("no-token", "the stream ended without a token"),
)
