"""A prebuilt kernel bundle (adapter: kimi-convert prebuild --out, KIMI_W31_KERNELS)."""

from __future__ import annotations

from ...converter.errors import Message, Reason

REASONS = (
    Reason(
        "kernel-bundle-invalid",
        rules={
            "unreadable": Message("no readable manifest ({error})"),
            "not-manifest": Message("not a kernel bundle manifest ({error})"),
        },
    ),
    Reason(
        "kernel-bundle-arch",
        "the bundle was built for another GPU architecture",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-flashinfer",
        "the bundle was built for another FlashInfer version",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-cuda",
        "the bundle was built for another CUDA version",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-torch",
        "the bundle was built for another torch version",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-python",
        "the bundle was built for another Python version",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-no-module",
        "the bundle has no {variant} module (it has: {have}); build it with `kimi-convert "
        "prebuild --precision {variant}`",
    ),
    Reason(
        "kernel-bundle-sources",
        "{module} was built from other sources or flags than this FlashInfer and plugin "
        "would compile",
        expected="{want}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-library",
        "the library is missing or not the one the manifest records",
        expected="{want}",
        found="{digest}",
    ),
    Reason(
        "kernel-bundle-missing",
        rules={
            "missing": Message("no kernel bundle here"),
            "not-directory": Message("not a directory ({kind}): a kernel bundle is a directory"),
        },
    ),
    Reason(
        "kernel-bundle-link",
        "a link in the bundle (-> {target}): a bundle holds its own files only, so what is "
        "checked is what is loaded",
    ),
    Reason(
        "kernel-bundle-not-regular",
        "not a regular file ({kind}): a bundle's manifest and libraries are plain files",
    ),
    Reason(
        "kernel-bundle-owner",
        "owned by uid {uid}, neither this user ({me}) nor root: another user could change "
        "the native code every serving process loads",
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
    ),
    Reason(
        "kernel-bundle-cpu",
        "the bundle was built for another CPU architecture",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-libc",
        "the bundle was built against another or a newer C library",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-python-abi",
        "the bundle was built for another Python ABI",
        expected="{running}",
        found="{built}",
    ),
    Reason(
        "kernel-bundle-busy",
        "another prebuild is publishing into this bundle ({who}); it did not finish within "
        "{seconds} s",
    ),
)
