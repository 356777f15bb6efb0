"""The memory budget's admission on real ONNX Runtime sessions of tiny models: refusal with the
numbers, the measured footprint replacing the estimate (kept in the store), release at close,
a budget at or below the agent's own memory. The process RSS is counted by the test (each load
adds a known amount) so that the numbers in the messages are exact."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from device_agents.budgets.memory import FOOTPRINTS_NAME, Footprints, MemoryBudget, MemoryBudgetError
from device_agents.runtimes import ServedModel, load_model
from edgekit.bundle.manifest import Estimates, Manifest
from tests.factories import make_cpu_bundle

MB = 1024 * 1024


class CountedRss:
    """The process's RSS as the test sets it: each ``loader`` adds its model's size."""

    def __init__(self, baseline_mb: int) -> None:
        self.bytes = baseline_mb * MB

    def __call__(self) -> int:
        return self.bytes


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, keypair: tuple[Path, Path]) -> Path:
    d = tmp_path_factory.mktemp("memory")
    bundle = make_cpu_bundle(d / "tiny.ekb", tiny_model, keypair[0])
    with tarfile.open(bundle, "r:gz") as tar:
        tar.extractall(d / "tiny", filter="data")
    return d / "tiny"


def manifest(extracted: Path, name: str, version: int = 1, peak_mb: float | None = None) -> Manifest:
    m = read_manifest_dir(extracted)
    estimates = None if peak_mb is None else Estimates(memory_mb=peak_mb * 0.8, peak_memory_mb=peak_mb)
    return replace(m, name=name, version=version, estimates=estimates)


def read_manifest_dir(directory: Path) -> Manifest:
    return Manifest.from_json((directory / "manifest.json").read_bytes())


def loader(extracted: Path, m: Manifest, rss: CountedRss, adds_mb: int) -> Callable[[], ServedModel]:
    def load() -> ServedModel:
        model = load_model(extracted, m)
        rss.bytes += adds_mb * MB
        return model

    return load


def test_memory_budget_refuses_a_model_that_does_not_fit_naming_memory_and_the_numbers(
    extracted: Path, tmp_path: Path
) -> None:
    rss = CountedRss(64)
    budget = MemoryBudget(256 * MB, footprints=Footprints(tmp_path / FOOTPRINTS_NAME), rss=rss)
    assert budget.baseline_bytes == 64 * MB
    cls, ocr = manifest(extracted, "cls", peak_mb=120), manifest(extracted, "ocr", peak_mb=90)
    budget.load(cls, loader(extracted, cls, rss, 100))
    budget.load(ocr, loader(extracted, ocr, rss, 80))
    det = manifest(extracted, "det", 3, peak_mb=412)
    with pytest.raises(MemoryBudgetError) as err:
        budget.load(det, loader(extracted, det, rss, 400))
    assert str(err.value).startswith(
        "det v3 needs ~412 MB (estimate), memory budget 256 MB: 64 MB the agent itself, 180 MB held by cls, ocr; "
        "raise [budgets] memory_mb or ship a smaller model"
    )
    assert (err.value.http_status, err.value.reason) == (503, "memory")
    small = manifest(extracted, "small", peak_mb=20)
    with pytest.raises(MemoryBudgetError, match=r'small v1 needs ~20 MB .* when_full = "unload_idle"') as err2:
        budget.load(small, loader(extracted, small, rss, 20))  # fits alone, not beside cls and ocr
    assert err2.value.retry_after_s == 1
    assert budget.state().held_by == {"cls": 100 * MB, "ocr": 80 * MB}
    assert budget.refusals == 2


def test_memory_budget_replaces_the_estimate_with_the_measured_load_kept_in_the_store(
    extracted: Path, tmp_path: Path
) -> None:
    rss = CountedRss(50)
    path = tmp_path / FOOTPRINTS_NAME
    budget = MemoryBudget(512 * MB, footprints=Footprints(path), rss=rss)
    cls = manifest(extracted, "cls", peak_mb=300)
    assert budget.need(cls) == (300 * MB, "estimate")
    model = budget.load(cls, loader(extracted, cls, rss, 100))
    assert budget.need(cls) == (100 * MB, "measured")
    model.close()
    # after a restart: the number measured on this device, not the host's estimate
    again = MemoryBudget(512 * MB, footprints=Footprints(path), rss=rss)
    assert again.need(cls) == (100 * MB, "measured")
    assert again.need(replace(cls, version=2)) == (300 * MB, "estimate")  # another version: measured anew
    # a later, smaller measurement (pages an unloaded model left in the allocator reused) does not shrink it
    again.load(cls, loader(extracted, cls, rss, 10)).close()
    assert again.need(cls) == (100 * MB, "measured")


def test_memory_budget_gives_back_what_a_model_held_when_it_is_closed(extracted: Path) -> None:
    rss = CountedRss(40)
    budget = MemoryBudget(200 * MB, rss=rss)
    a = manifest(extracted, "a", peak_mb=90)
    model = budget.load(a, loader(extracted, a, rss, 90))
    assert budget.held_bytes() == 90 * MB
    b = manifest(extracted, "b", peak_mb=90)
    with pytest.raises(MemoryBudgetError):
        budget.load(b, loader(extracted, b, rss, 90))
    model.close()
    rss.bytes -= 90 * MB
    assert budget.held_bytes() == 0
    budget.load(b, loader(extracted, b, rss, 90))
    assert budget.state().held_by == {"b": 90 * MB}


def test_memory_budget_at_or_below_the_agent_itself_admits_no_model(extracted: Path) -> None:
    rss = CountedRss(120)
    budget = MemoryBudget(100 * MB, rss=rss)
    unknown = manifest(extracted, "tiny")  # no estimate: would be admitted while anything is free
    with pytest.raises(MemoryBudgetError, match="at or below the agent's own memory, so no model is admitted"):
        budget.load(unknown, loader(extracted, unknown, rss, 1))
    with pytest.raises(MemoryBudgetError, match="needs an unknown amount, memory budget 100 MB: 120 MB the agent"):
        budget.check_installable(unknown)


def test_memory_budget_install_check_counts_others_only_when_refusing(extracted: Path) -> None:
    rss = CountedRss(50)
    refuse = MemoryBudget(200 * MB, rss=rss)
    held = manifest(extracted, "cls", peak_mb=100)
    refuse.load(held, loader(extracted, held, rss, 100))
    refuse.check_installable(replace(held, version=2, estimates=Estimates(peak_memory_mb=140)))  # replaces itself
    with pytest.raises(MemoryBudgetError, match="det v1 needs ~60 MB"):
        refuse.check_installable(manifest(extracted, "det", peak_mb=60))
    unload = MemoryBudget(200 * MB, rss=rss, when_full="unload_idle", baseline_bytes=50 * MB)
    unload.check_installable(manifest(extracted, "det", peak_mb=60))  # fits once cls is unloaded
    with pytest.raises(MemoryBudgetError, match="needs ~160 MB"):
        unload.check_installable(manifest(extracted, "det", peak_mb=160))


def test_memory_budget_unloads_what_evict_gives_until_the_model_fits(extracted: Path) -> None:
    rss = CountedRss(50)
    budget = MemoryBudget(200 * MB, rss=rss, when_full="unload_idle", reload="retry_after")
    loaded: dict[str, ServedModel] = {}
    order: list[str] = []
    for name in ("a", "b", "c"):
        m = manifest(extracted, name, peak_mb=45)
        loaded[name] = budget.load(m, loader(extracted, m, rss, 45))
        order.append(name)

    def evict(keep: object, drain_s: float) -> str | None:  # the registry's LRU, here the load order
        for name in order:
            if name not in keep:  # type: ignore[operator]  # a Container
                order.remove(name)
                loaded.pop(name).close()
                rss.bytes -= 45 * MB
                return name
        return None

    budget.evict = evict
    d = manifest(extracted, "d", peak_mb=80)
    with pytest.raises(MemoryBudgetError, match="fits once others are unloaded: retry shortly"):
        budget.load(d, loader(extracted, d, rss, 80), on_demand=True)  # reload = retry_after: no unloading
    budget.load(d, loader(extracted, d, rss, 80))  # a load at start or install unloads a and b
    assert sorted(budget.state().held_by) == ["c", "d"] and budget.unloads == 2


def test_memory_budget_counts_memory_held_by_neither_the_agent_nor_a_model(extracted: Path) -> None:
    rss = CountedRss(50)
    budget = MemoryBudget(200 * MB, rss=rss)
    cls = manifest(extracted, "cls", peak_mb=60)
    budget.load(cls, loader(extracted, cls, rss, 60))
    rss.bytes += 70 * MB  # request buffers, caches: the budget is on the RSS as measured
    det = manifest(extracted, "det", peak_mb=30)
    with pytest.raises(
        MemoryBudgetError, match=r"det v1 needs ~30 MB .* 50 MB the agent itself, 60 MB held by cls, 70 MB other"
    ):
        budget.load(det, loader(extracted, det, rss, 30))
    rss.bytes -= 40 * MB
    budget.load(det, loader(extracted, det, rss, 30))


def test_memory_budget_admits_on_the_peak_of_a_load_and_holds_what_it_keeps(extracted: Path, tmp_path: Path) -> None:
    import time

    rss = CountedRss(50)
    budget = MemoryBudget(400 * MB, footprints=Footprints(tmp_path / FOOTPRINTS_NAME), rss=rss)
    cls = manifest(extracted, "cls")

    def load() -> ServedModel:  # the weights read and parsed (+150 MB), then kept (+60 MB)
        rss.bytes += 150 * MB
        time.sleep(0.05)
        model = load_model(extracted, cls)
        rss.bytes -= 90 * MB
        return model

    budget.load(cls, load)
    assert budget.state().held_by == {"cls": 60 * MB}
    assert budget.need(cls) == (150 * MB, "measured")


def test_memory_budget_says_whether_a_model_fits_now_without_unloading(extracted: Path) -> None:
    rss = CountedRss(50)
    budget = MemoryBudget(200 * MB, rss=rss, when_full="unload_idle")
    cls = manifest(extracted, "cls", peak_mb=100)
    budget.load(cls, loader(extracted, cls, rss, 100))
    assert budget.fits_now(manifest(extracted, "small", peak_mb=40))
    assert not budget.fits_now(manifest(extracted, "big", peak_mb=60))  # would need cls unloaded
    assert budget.fits_now(replace(cls, version=2))  # its own name's holding does not count against it
