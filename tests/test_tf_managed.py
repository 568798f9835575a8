"""TensorFlow-managed checkpoints (issue 21, item 5): a shardkit manager in TensorFlow's format
that TensorFlow's own manager, ``latest_checkpoint`` and restore see; ``save_counter`` as
TensorFlow handles it; the object graph of ``convert --to tensorflow``; error paths."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from tfhelpers import bits, keras_model

import shardkit
from shardkit.errors import CheckpointNotFoundError, CorruptIndexError


def _values(model, opt):
    """Every variable of `model` and `opt` (Adam's slots too), in order, as its bits."""
    return [bits(v.numpy()) for v in [*model.variables, *opt.variables]]


def _trained(keras, seed):
    """A Keras MLP with Adam, trained a few steps (so the slots hold values)."""
    model, opt = keras_model(keras, 4, 8, 2, activation="relu", seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    return model, opt


@pytest.fixture(scope="module")
def saved(tf, keras, tmp_path_factory):
    """A shardkit TensorFlow-format manager's directory after 4 saves with max_to_keep=2
    (the model trained between saves), with the variables as they were at the last save."""
    directory = str(tmp_path_factory.mktemp("tfm") / "run")
    model, opt = _trained(keras, 0)
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt)
    manager = shardkit.CheckpointManager(ckpt, directory, max_to_keep=2, format="tensorflow")
    x = np.ones((8, 4), np.float32)
    paths, stamps = [], []
    for _ in range(4):
        model.train_on_batch(x, np.zeros((8, 2), np.float32))
        before = time.time()
        paths.append(manager.save())
        stamps.append((before, time.time()))
    last = _values(model, opt)
    return directory, manager, paths, stamps, last


def test_tensorflow_sees_every_kept_checkpoint(tf, keras, saved):
    directory, manager, paths, _, last = saved
    assert [str(p) for p in paths] == [os.path.join(directory, f"ckpt-{i}") for i in (1, 2, 3, 4)]
    kept = [os.path.join(directory, "ckpt-3"), os.path.join(directory, "ckpt-4")]
    assert sorted(os.listdir(directory)) == sorted(
        ["checkpoint", "ckpt-3.index", "ckpt-3.data-00000-of-00001",
         "ckpt-4.index", "ckpt-4.data-00000-of-00001"])
    assert tf.train.latest_checkpoint(directory) == kept[-1]
    state = tf.train.get_checkpoint_state(directory)
    assert state.model_checkpoint_path == kept[-1]
    assert list(state.all_model_checkpoint_paths) == kept
    fresh, fresh_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=7)
    tf_manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=fresh, optimizer=fresh_opt), directory, max_to_keep=2)
    assert tf_manager.checkpoints == kept and tf_manager.latest_checkpoint == kept[-1]
    assert manager.checkpoints == kept and manager.latest_checkpoint == kept[-1]
    reader = tf.train.load_checkpoint(directory)
    assert int(reader.get_tensor("save_counter/.ATTRIBUTES/VARIABLE_VALUE")) == 4
    # TensorFlow's own restore: every object in the graph matched, every value bit-exact
    root = tf.train.Checkpoint(model=fresh, optimizer=fresh_opt)
    root.restore(tf.train.latest_checkpoint(directory)).assert_consumed()
    got = _values(fresh, fresh_opt)
    assert got == last
    assert int(root.save_counter.numpy()) == 4
    assert int(fresh_opt.iterations.numpy()) > 0


def test_state_file_timestamps(tf, saved):
    directory, _, _, stamps, _ = saved
    from shardkit.adapters.tensorbundle.protos import CheckpointState, text_format

    with open(os.path.join(directory, "checkpoint")) as f:
        text = f.read()
    state = text_format.Parse(text, CheckpointState())
    assert state.model_checkpoint_path == "ckpt-4"  # relative, as TensorFlow's manager writes
    assert list(state.all_model_checkpoint_paths) == ["ckpt-3", "ckpt-4"]
    times = list(state.all_model_checkpoint_timestamps)
    assert len(times) == 2 and times[0] < times[1]
    for t, (lo, hi) in zip(times, stamps[2:]):
        assert lo <= t <= hi
    assert 0 < state.last_preserved_timestamp <= stamps[0][0]
    assert text == text_format.MessageToString(state)


def test_shardkit_manager_restores_tensorflow_managed_directories(tf, keras, saved, tmp_path):
    directory, _, _, _, last = saved
    fresh, fresh_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=9)
    ckpt = shardkit.Checkpoint(model=fresh, optimizer=fresh_opt)
    manager = shardkit.CheckpointManager(ckpt, directory, max_to_keep=2, format="tensorflow")
    assert manager.restore_or_initialize() == os.path.join(directory, "ckpt-4")
    assert _values(fresh, fresh_opt) == last
    assert ckpt.save_counter == 4
    # a directory TensorFlow's own manager wrote: listed, restored, and managed further
    tf_dir = str(tmp_path / "tf")
    model, opt = _trained(keras, 3)
    tf_manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt),
                                            tf_dir, max_to_keep=3)
    for _ in range(2):
        tf_manager.save()
    want = _values(model, opt)
    other, other_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=11)
    ours = shardkit.CheckpointManager(shardkit.Checkpoint(model=other, optimizer=other_opt),
                                      tf_dir, max_to_keep=2, format="tensorflow")
    assert ours.checkpoints == tf_manager.checkpoints
    assert ours.restore_or_initialize() == tf_manager.latest_checkpoint
    assert _values(other, other_opt) == want
    assert ours.save() == os.path.join(tf_dir, "ckpt-3")
    assert tf.train.get_checkpoint_state(tf_dir).all_model_checkpoint_paths == [
        os.path.join(tf_dir, "ckpt-2"), os.path.join(tf_dir, "ckpt-3")]
    assert not os.path.exists(os.path.join(tf_dir, "ckpt-1.index"))


def test_a_failed_save_leaves_the_state_file_at_the_last_complete_one(tf, keras, tmp_path,
                                                                     monkeypatch):
    model, opt = _trained(keras, 1)
    directory = str(tmp_path / "run")
    manager = shardkit.CheckpointManager(shardkit.Checkpoint(model=model, optimizer=opt),
                                         directory, max_to_keep=2, format="tensorflow")
    manager.save()
    with open(os.path.join(directory, "checkpoint")) as f:
        before = f.read()
    from shardkit.adapters.tensorbundle import writer

    def broken(*args, **kwargs):
        raise OSError("disk failed")

    monkeypatch.setattr(writer, "publish", broken)
    with pytest.raises(OSError, match="disk failed"):
        manager.save()
    monkeypatch.undo()
    with open(os.path.join(directory, "checkpoint")) as f:
        assert f.read() == before
    assert tf.train.latest_checkpoint(directory) == os.path.join(directory, "ckpt-1")
    tf.train.Checkpoint(model=model, optimizer=opt).restore(
        tf.train.latest_checkpoint(directory)).assert_consumed()
    assert not os.path.exists(os.path.join(directory, "ckpt-2.index"))


def test_restore_into_a_tensorflow_save_prefix_creates_the_save_counter(tf, keras, tmp_path):
    model, opt = _trained(keras, 2)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "tf" / "ck"))
    fresh, fresh_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=5)
    root = tf.train.Checkpoint(model=fresh, optimizer=fresh_opt)
    shardkit.restore_into(prefix, root).assert_consumed()
    assert int(root.save_counter.numpy()) == 1
    assert (_values(fresh, fresh_opt)
            == _values(model, opt))


def test_error_paths(tf, keras, tmp_path):
    model, opt = _trained(keras, 4)
    directory = str(tmp_path / "run")
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt)
    manager = shardkit.CheckpointManager(ckpt, directory, format="tensorflow")
    manager.save()
    manager.save()
    for name in os.listdir(directory):
        if name.startswith("ckpt-2."):
            os.unlink(os.path.join(directory, name))
    with pytest.raises(CheckpointNotFoundError, match=r"names 'ckpt-2'.*ckpt-2.index is missing"):
        manager.restore_or_initialize()
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write("model_checkpoint_path: \"ckpt-1\"\nnot a field\n")
    with pytest.raises(CorruptIndexError, match="not a text-format CheckpointState"):
        _ = manager.latest_checkpoint
    with pytest.raises(CorruptIndexError, match="not a text-format CheckpointState"):
        manager.save()
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "../elsewhere/ckpt-1"\n')
    with pytest.raises(CheckpointNotFoundError, match="is not in"):
        _ = manager.checkpoints
    with pytest.raises(shardkit.errors.InvalidArgumentError, match="format must be"):
        shardkit.CheckpointManager(ckpt, directory, format="tf")


def test_convert_a_checkpoint_to_tensorflow_writes_the_object_graph(tf, keras, tmp_path):
    """A shardkit `Checkpoint(model, optimizer)` converted to TensorFlow's format has the keys
    ``tf.train.Checkpoint(model=, optimizer=).save`` gives (each variable once, by its
    shortest path: the compiled model's weights are its optimizer's ``_trainable_variables``,
    not also ``model/optimizer/...``), and both TensorFlow and shardkit restore it bit-exact:
    weights, Adam's slots, iterations and the save counter."""
    from shardkit.tools.cli import main

    model, opt = _trained(keras, 6)
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt)
    ckpt.save(tmp_path / "sk" / "ckpt")
    ckpt.save(tmp_path / "sk" / "ckpt")
    prefix = str(tmp_path / "tf" / "ckpt-2")
    assert main(["convert", str(tmp_path / "sk" / "ckpt-2"), prefix, "--to", "tensorflow"]) == 0
    real = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "real" / "ck"))
    assert (sorted(n for n, _ in tf.train.list_variables(prefix))
            == sorted(n for n, _ in tf.train.list_variables(real)))
    assert not any(n.startswith("model/") for n, _ in tf.train.list_variables(prefix))
    want = _values(model, opt)
    fresh, fresh_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=8)
    root = tf.train.Checkpoint(model=fresh, optimizer=fresh_opt)
    root.restore(prefix).assert_consumed()
    assert _values(fresh, fresh_opt) == want
    assert int(root.save_counter.numpy()) == 2
    assert int(fresh_opt.iterations.numpy()) == int(opt.iterations.numpy()) > 0
    ours, ours_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=10)
    back = shardkit.Checkpoint(model=ours, optimizer=ours_opt)
    back.read(prefix).assert_consumed()
    assert _values(ours, ours_opt) == want
    assert back.save_counter == 2
    assert int(ours_opt.iterations.numpy()) == int(opt.iterations.numpy())


def test_checkpoint_reads_its_saves_of_before_the_joint_keys(tf, keras, tmp_path):
    """A shardkit-format `Checkpoint` save of TensorFlow objects written before they were
    stored under the joint graph's keys (each object under its own: ``model/optimizer/...``
    beside ``optimizer/...``, the layout entry without ``"joint"``) still restores."""
    model, opt = _trained(keras, 15)
    tfw = shardkit.frameworks.module("tensorflow")
    state = {f"{name}/{key}": variable for name, obj in (("model", model), ("optimizer", opt))
             for key, variable in tfw.object_variables(obj).items()}
    assert any(k.startswith("model/optimizer/") for k in state)
    from shardkit.training.checkpoint import METADATA_KEY

    layout = {"version": 1, "objects": {
        name: {"kind": "tensorflow", "tree": {"d": [
            [k[len(name) + 1:], {"x": k, "k": "tensorflow"}]
            for k in state if k.startswith(name + "/")]}}
        for name in ("model", "optimizer")}}
    state["save_counter"] = np.array(3, np.int64)
    shardkit.save(tmp_path / "old", state, metadata={METADATA_KEY: layout})
    fresh, fresh_opt = keras_model(keras, 4, 8, 2, activation="relu", seed=16)
    back = shardkit.Checkpoint(model=fresh, optimizer=fresh_opt)
    back.read(tmp_path / "old").assert_consumed()
    assert _values(fresh, fresh_opt) == _values(model, opt)
    assert back.save_counter == 3


def test_object_graph_keys_are_unescaped_as_tensorflow_escapes_them():
    from shardkit.adapters.tensorbundle.object_graph import split_key

    assert split_key("a/b./c/.ATTRIBUTES/VARIABLE_VALUE") == (["a", "b/c"], "VARIABLE_VALUE")
    assert split_key("x/..ATTRIBUTES/.ATTRIBUTES/V") == (["x", ".ATTRIBUTES"], "V")
    assert split_key("save_counter") is None
    assert split_key("a/.ATTRIBUTES/b/.ATTRIBUTES/V") is None


def _unbuilt(keras, seed):
    """The Keras MLP of `keras_model`, compiled, its Adam not built (no slots yet)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(learning_rate=0.01)
    model.compile(opt, "mse")
    return model, opt


def test_restore_into_an_unbuilt_optimizer_defers_its_slots(tf, keras, tmp_path):
    model, opt = _trained(keras, 12)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "tf" / "ck"))
    ours, ours_opt = _unbuilt(keras, 13)
    theirs, theirs_opt = _unbuilt(keras, 14)
    assert not ours_opt.built
    status = shardkit.restore_into(prefix, {"model": ours, "optimizer": ours_opt})
    assert status.unexpected_keys  # the slots: pending until the optimizer builds
    assert not status.missing_keys
    tf.train.Checkpoint(model=theirs, optimizer=theirs_opt).read(prefix)
    rng = np.random.default_rng(0)
    for _ in range(3):  # building the optimizer restores the slots; training goes on the same
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 2)).astype(np.float32)
        assert bits(ours.train_on_batch(x, y)) == bits(theirs.train_on_batch(x, y))
    assert _values(ours, ours_opt) == _values(theirs, theirs_opt)
    assert int(ours_opt.iterations.numpy()) == int(opt.iterations.numpy()) + 3


@pytest.mark.parametrize("case", ["wrong shape", "unmatched variable"])
def test_a_deferred_restore_checks_everything_before_it_assigns(tf, keras, tmp_path, case):
    """The deferred restore (TensorFlow's read, into an unbuilt optimizer) binds the objects
    by the graph and assigns as it goes: a mismatch found late (the last layer's kernel of
    another shape; a variable the graph has no value for) raises before anything changed."""
    from shardkit.errors import RestoreMismatchError

    model, opt = _trained(keras, 17)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "tf" / "ck"))
    keras.utils.set_random_seed(18)
    outputs = 3 if case == "wrong shape" else 2
    ours = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(outputs)])
    ours_opt = keras.optimizers.Adam(learning_rate=0.01)
    ours.compile(ours_opt, "mse")
    ours_opt.iterations.assign(5)
    target = {"model": ours, "optimizer": ours_opt}
    variables = [*ours.variables, *ours_opt.variables]
    if case == "unmatched variable":
        extra = tf.Module()
        extra.w = tf.Variable(np.arange(3, dtype=np.float32))
        target["extra"] = extra
        variables.append(extra.w)
    before = [bits(v.numpy()) for v in variables]
    match = (r"'model/_functional/_operations/2/_kernel'.*has 'optimizer/_trainable_variables/2/"
             r"\.ATTRIBUTES/VARIABLE_VALUE' of shape \[8, 2\].*shape \[8, 3\].*nothing was changed"
             if case == "wrong shape" else
             r"graph has no object for 1 variable\(s\) of the target: 'extra/w/.*nothing was "
             r"changed")
    with pytest.raises(RestoreMismatchError, match=match):
        shardkit.restore_into(prefix, target)
    assert [bits(v.numpy()) for v in variables] == before
    assert not ours_opt.built


def test_prefixes_found_without_a_state_file_stay_managed(tf, keras, tmp_path):
    """A directory whose save was killed before its first state file (committed prefixes, no
    ``checkpoint``): a manager created later lists them, and the state file its next save
    writes has them managed by TensorFlow's manager too (stamped after last_preserved)."""
    model, opt = _trained(keras, 19)
    directory = str(tmp_path / "run")
    first = shardkit.CheckpointManager(shardkit.Checkpoint(model=model, optimizer=opt),
                                       directory, max_to_keep=3, format="tensorflow")
    first.save()
    os.unlink(os.path.join(directory, "checkpoint"))
    time.sleep(0.05)
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt)
    manager = shardkit.CheckpointManager(ckpt, directory, max_to_keep=3, format="tensorflow")
    assert manager.restore_or_initialize() == os.path.join(directory, "ckpt-1")
    manager.save()
    kept = [os.path.join(directory, f"ckpt-{i}") for i in (1, 2)]
    assert manager.checkpoints == kept
    tf_manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt),
                                            directory, max_to_keep=3)
    assert tf_manager.checkpoints == kept
