"""The seams between packages (issue 20, item 5): what `meshfit._protocols` declares is what the
implementations offer, the data package's public node API, and the typing marker that ships."""

from __future__ import annotations

import os

import pytest

import meshfit as mf
from meshfit import _protocols
from meshfit.callbacks import Callback, CallbackList
from meshfit.data import Batch, Dataset, Shuffle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _members(protocol: type) -> set[str]:
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


@pytest.mark.parametrize("protocol, implementation", [
    (_protocols.CallbackLike, Callback()),
    (_protocols.CallbackListLike, CallbackList()),
])
def test_callbacks_offer_every_member_of_their_protocol(protocol, implementation):
    missing = sorted(n for n in _members(protocol) if not hasattr(implementation, n))
    assert not missing, f"{type(implementation).__name__} lacks {missing}"


def test_a_plain_callback_has_the_loops_defaults():
    callback = Callback()
    assert callback.reads_batch_logs is True
    assert callback.run_last is False
    assert callback.handles_preemption is False
    callback.save_for_preemption()  # a no-op, callable on every callback


def test_data_sources_offer_the_random_access_protocol():
    import torch

    from meshfit._engine._data_handler import DataHandler, _StreamSource

    class Loader:  # an iterable of batches with a length, read as a stream
        def __iter__(self):
            return iter([torch.tensor([1, 2]), torch.tensor([3, 4])])

        def __len__(self):
            return 2

    strategy = mf.distribute.OneDeviceStrategy("cpu")
    view = strategy.experimental_distribute_dataset(Dataset.range(6).batch(2))
    stream = DataHandler(Loader(), None, None, None, None, False, strategy).source
    assert isinstance(stream, _StreamSource)
    for source in (view, stream):
        missing = sorted(n for n in _members(_protocols.DataSource) if not hasattr(source, n))
        assert not missing, f"{type(source).__name__} lacks {missing}"
    assert view.length() == 3
    assert view.replica_batch(1, 0)[0].tolist() == [2, 3]
    assert view.replicas_read_different_rows is True
    assert stream.length() == 2 and stream.prefetch_size() == 0


def test_the_node_api_reads_a_pipeline_without_private_methods():
    dataset = Dataset.range(6).shuffle(6, seed=0).batch(2)
    node = dataset.node
    assert isinstance(node, Batch) and isinstance(node.inner, Shuffle)
    assert [type(n).__name__ for n in node.nodes()] == ["Batch", "Shuffle", "Range"]
    assert node.nodes()[-1].inner is None
    assert node.length() == 3
    first = [node.get(i, 0).tolist() for i in range(3)]
    assert first == [b.tolist() for b in dataset]  # the first iterator reads pass 0
    assert node.prefetch_size() == 0 and dataset.prefetch(2).node.prefetch_size() == 2
    unbatched = node.transform_chain(lambda n: n.inner if isinstance(n, Batch) else None)
    assert unbatched.length() == 6 and isinstance(unbatched, Shuffle)


def test_reseed_changes_the_order_and_start_and_end_pass_move_the_next_iterator():
    dataset = Dataset.range(8).shuffle(8, seed=1)
    shuffle = dataset.node
    before = [int(shuffle.get(i, 0)) for i in range(8)]
    shuffle.reseed(2)
    after = [int(shuffle.get(i, 0)) for i in range(8)]
    assert sorted(after) == list(range(8)) and after != before
    assert shuffle.seed == 2
    assert dataset.start_pass() == 0 and dataset.start_pass() == 1
    dataset.end_pass(4)
    assert dataset.start_pass() == 5
    dataset.end_pass(0)  # never moves back
    assert dataset.start_pass() == 6


def test_protocols_module_imports_nothing_from_meshfit():
    """The contracts import nothing of meshfit's but their own package's modules (no cycle can start there)."""
    folder = os.path.dirname(_protocols.__file__)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                lines = [line for line in f if "meshfit" in line and "import" in line]
            outside = [line for line in lines if not line.lstrip().startswith("from meshfit._protocols.")]
            assert not outside, (name, outside)


def test_the_package_ships_its_typing_marker():
    assert os.path.exists(os.path.join(ROOT, "meshfit", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    assert 'meshfit = ["py.typed"]' in pyproject
    assert "[tool.mypy]" in pyproject and "mypy>=" in pyproject
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "$(BIN)/mypy" in f.read()
