"""A prebuilt kernel bundle (adapter: kimi-convert prebuild --out, KIMI_W31_KERNELS)."""

from __future__ import annotations

from ...converter.errors import Message, Reason

# What to do about a bundle this stack must not load: the hint of every refusal below but
# the ones with a remedy of their own (permissions, a busy publisher).
REBUILD = (
    "rebuild it with `kimi-convert prebuild --out DIR` in this stack, or unset "
    "KIMI_W31_KERNELS to build into FlashInfer's cache on first use"
)

REASONS = (
    Reason(
        "kernel-bundle-invalid",
        rules={
            "unreadable": Message("no readable manifest ({error})", hint=REBUILD),
            "not-manifest": Message("not a kernel bundle manifest ({error})", hint=REBUILD),
        },
    ),
    Reason(
        "kernel-bundle-arch",
        "the bundle was built for another GPU architecture",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-flashinfer",
        "the bundle was built for another FlashInfer version",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-cuda",
        "the bundle was built for another CUDA version",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-torch",
        "the bundle was built for another torch version",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-python",
        "the bundle was built for another Python version",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-no-module",
        "the bundle has no {variant} module (it has: {have}); build it with `kimi-convert "
        "prebuild --precision {variant}`",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-sources",
        "{module} was built from other sources or flags than this FlashInfer and plugin "
        "would compile",
        expected="{want}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-library",
        "the library is missing or not the one the manifest records",
        expected="{want}",
        found="{digest}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-missing",
        rules={
            "missing": Message("no kernel bundle here", hint=REBUILD),
            "not-directory": Message(
                "not a directory ({kind}): a kernel bundle is a directory", hint=REBUILD
            ),
        },
    ),
    Reason(
        "kernel-bundle-link",
        "a link in the bundle (-> {target}): a bundle holds its own files only, so what is "
        "checked is what is loaded",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-not-regular",
        "not a regular file ({kind}): a bundle's manifest and libraries are plain files",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-owner",
        "owned by uid {uid}, neither this user ({me}) nor root: another user could change "
        "the native code every serving process loads",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-writable",
        "writable by group or others (mode {mode}): anyone who can write it can change the "
        "native code every serving process loads",
        hint="chmod go-w the bundle directory and its files",
    ),
    Reason(
        "kernel-bundle-too-large",
        "larger than a bundle's {what} can be ({size} bytes, at most {limit})",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-cpu",
        "the bundle was built for another CPU architecture",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-libc",
        "the bundle was built against another or a newer C library",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-python-abi",
        "the bundle was built for another Python ABI",
        expected="{running}",
        found="{built}",
        hint=REBUILD,
    ),
    Reason(
        "kernel-bundle-busy",
        "another prebuild is publishing into this bundle ({who}); it did not finish within "
        "{seconds} s",
    ),
)
