"""The streaming executor's seams.

- One window model: `fewest_slots` (what the estimate and the window check report) agrees
  with the live set restated from its definition, over generated layouts.
- The executor asks an origin only what `Remote` declares: an origin written here, in one
  file's worth of code, that "downloads" by copying from a folder, streams a conversion
  byte-identical to a local one, deleting each source shard once its readers are written.
- `Origin.resolve` returns what it learnt; the origin keeps nothing.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hub_server import FakeHub
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter.contract import CHECKSUMS_NAME, CONFIG_NAME
from kimi_w31.converter.execute.download import DownloadExecutor
from kimi_w31.converter.execute.remote import Remote
from kimi_w31.converter.execute.stream import Window, download_order, estimate, fewest_slots
from kimi_w31.converter.pipeline import ConvertOptions, convert, prepare, source_id
from kimi_w31.converter.source import Resolved, Source, SourceReader
from kimi_w31.converter.source.hub import HubOrigin
from kimi_w31.converter.source.local import LocalOrigin
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

# -- one window model ----------------------------------------------------------------------------


@dataclasses.dataclass
class Shard:  # the members of an output shard the window reads
    name: str
    input_files: list[str]
    file_size: int = 1


layouts = st.integers(1, 7).flatmap(
    lambda n: st.lists(
        st.sets(st.integers(0, n - 1), min_size=1, max_size=n), min_size=1, max_size=9
    ).map(
        lambda groups: (
            [f"s{i}" for i in range(n)],
            [Shard(f"o{j}", sorted(f"s{i}" for i in g)) for j, g in enumerate(groups)],
        )
    )
)


def live_after_each_arrival(shards: list[Shard], file_order: list[str]) -> list[int]:
    """From the definition: as the k-th source shard (in download order) arrives, a source
    shard is live if it is that one, or if some output shard reading it lacked one of its
    sources until now (output shards are written as soon as their sources are present)."""
    order = download_order(shards, file_order)  # type: ignore[arg-type]
    sizes = []
    for k, newest in enumerate(order):
        before, present = set(order[:k]), set(order[: k + 1])
        waiting = [s for s in shards if not set(s.input_files) <= before]
        live = {f for f in present if any(f in s.input_files for s in waiting)} | {newest}
        sizes.append(len(live))
    return sizes


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_fewest_slots_is_the_largest_live_set_of_the_definition(layout):
    file_order, shards = layout
    assert fewest_slots(shards, file_order) == max(live_after_each_arrival(shards, file_order))  # type: ignore[arg-type]
    est = estimate(shards, file_order, dict.fromkeys(file_order, 5), 0, 2, delete=True)  # type: ignore[arg-type]
    assert est.min_window == fewest_slots(shards, file_order)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(layouts, st.randoms(use_true_random=False))
def test_the_window_hands_out_each_output_shard_once_whatever_the_arrival_order(layout, rnd):
    file_order, shards = layout
    window = Window(shards, file_order)  # type: ignore[arg-type]
    taken = [window.take() for _ in range(len(window.queue))]
    rnd.shuffle(taken)  # downloads finish in any order
    ready = [name for f in taken for name in window.arrive(f)]
    assert sorted(ready) == sorted(s.name for s in shards)
    by_name = {s.name: s for s in shards}
    freed = [f for name in ready for f in window.finish(name, by_name[name].input_files)]
    assert sorted(freed) == sorted(window.order) and not window.live


# -- a second origin, from the protocol alone -----------------------------------------------------


class _NoHook:
    def install(self) -> None: ...

    def remove(self) -> None: ...


class _NoPartials:  # copies are never partial: nothing to record or remove
    def open(self) -> list[Path]:
        return []

    def owns(self, path: Path) -> bool:
        return False

    def remove(self, path: Path) -> int | None:
        return None

    def on_created(self, callback: Callable[[Path | None], None]) -> _NoHook:
        return _NoHook()


@dataclasses.dataclass(frozen=True)
class FolderSnapshot:
    """A 'remote' folder: headers read in place, shards copied into `storage` when fetched."""

    remote: Path
    storage: Path
    kind: str = "folder"
    header_workers: int = 1
    partials: _NoPartials = dataclasses.field(default_factory=_NoPartials)

    def has_file(self, root: Path, name: str) -> bool:
        return (self.remote / name).exists()

    def read_header(self, root: Path, file: str):
        return LocalOrigin().read_header(self.remote, file)

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]:
        return LocalOrigin().extra_files(self.remote, weight_files)

    def top_level_names(self, root: Path) -> list[str]:
        return LocalOrigin().top_level_names(self.remote)

    def size(self, file: str) -> int:
        return (self.remote / file).stat().st_size

    def content_id(self, file: str) -> list:
        return [self.size(file), file]

    def other_bytes(self) -> int:
        return 0

    def rows(self) -> list[tuple[str, str]]:
        return [("folder", str(self.remote))]

    def summary(self) -> dict:
        return {"folder": str(self.remote)}

    def fetch(self, file, hooks) -> None:
        hooks.on_open()
        shutil.copyfile(self.remote / file, self.storage / file)
        hooks.on_bytes(self.size(file))

    def delete(self, root: Path, file: str) -> int:
        size = (root / file).stat().st_size if (root / file).exists() else 0
        (root / file).unlink(missing_ok=True)
        return size


@dataclasses.dataclass(frozen=True)
class FolderOrigin:
    storage: Path

    def resolve(self, spec: str, revision: str | None) -> Resolved:
        remote = Path(spec)
        self.storage.mkdir(parents=True, exist_ok=True)
        for p in remote.rglob("*"):  # the small files first, as the Hub origin does
            if p.is_file() and not p.name.endswith(".safetensors"):
                dst = self.storage / p.relative_to(remote)  # assets/ included
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dst)
        return Resolved(self.storage, FolderSnapshot(remote, self.storage))


def test_a_new_origin_needs_only_the_remote_protocol(small_source, converted, tmp_path):
    storage = tmp_path / "dl" / small_source.name  # the output names its source by folder
    origin = FolderOrigin(storage)
    snapshot = origin.resolve(str(small_source), None).reader
    assert isinstance(snapshot, Remote)  # the protocol is all the executor asks for
    executor = DownloadExecutor(window=3, delete_source_shards=True)
    result = convert(
        ConvertOptions(
            str(small_source),
            tmp_path / "out",
            manifest="kimi-k3-any",
            max_shard_size=600_000,
            origin=origin,
            executor=executor,
        )
    )
    assert result.outcomes
    written = sorted(p.name for p in converted.iterdir() if p.is_file())
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_file()) == written
    for name in set(written) - {CHECKSUMS_NAME}:  # which records name sources differently
        assert (tmp_path / "out" / name).read_bytes() == (converted / name).read_bytes(), name
    assert not list(storage.glob("*.safetensors"))  # each freed once read
    block = executor.summary(result.plan)["folder"]
    assert block["folder"] == str(small_source)
    assert block["downloaded_files"] == block["deleted_files"] == len(result.source.shard_files)


def test_the_streaming_executor_refuses_a_source_read_from_disk(small_source):
    with pytest.raises(TypeError):
        DownloadExecutor().open_sources(Source(small_source, "local", {}, [], reader=LocalOrigin()))


# -- resolve returns a value ----------------------------------------------------------------------


def test_hub_resolve_returns_the_snapshot_and_the_origin_keeps_nothing(tmp_path):
    repo = tmp_path / "repo"
    synth_checkpoint(repo, SynthSpec(layers=2, experts=4, shards=2))
    with FakeHub({"org/r": repo}) as hub:
        origin = HubOrigin(download_dir=tmp_path / "dl", endpoint=hub.endpoint)
        before = dataclasses.replace(origin)
        found = origin.resolve("org/r", None)
        again = origin.resolve("org/r", None)
    assert origin == before  # frozen: resolving fills nothing in
    assert found == again and found.root == tmp_path / "dl"
    assert (found.root / CONFIG_NAME).is_file()
    assert isinstance(found.reader, Remote)
    reader: SourceReader = found.reader
    assert reader.has_file(found.root, CONFIG_NAME)
    assert not list(found.root.glob("*.safetensors"))  # shards wait for the executor
    with pytest.raises(dataclasses.FrozenInstanceError):
        origin.download_dir = None  # type: ignore[misc]
    # What resolve learnt reaches what follows: the source is named by repo and commit, even
    # in a --download-dir folder that is no cache snapshot.
    with FakeHub({"org/r": repo}) as hub:
        opts = ConvertOptions("org/r", tmp_path / "out", manifest="kimi-k3-any")
        opts.origin = HubOrigin(download_dir=tmp_path / "dl2", endpoint=hub.endpoint)
        source, _, _ = prepare(opts)
    assert source_id(source, source.reader).key == f"hub:org/r@{FakeHub.commit}"
