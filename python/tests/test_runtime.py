"""The low-level API: DLPack sharing without a copy, released tensors that cannot be read,
Rust errors as Python exceptions, state dicts."""

import pytest
import torch

import oogc


def runtime(tmp_path=None, **budgets):
    cfg = {"budgets": {"gpu": "1 MiB", **budgets}, "optimizer": {"clip_norm": 0.0}}
    return oogc.Runtime(cfg)


def one_unit(n=1000):
    rt = runtime()
    init = torch.arange(n, dtype=torch.float32)
    assert rt.add_unit("a", n, init) == 0
    return rt, init


def finish(rt):
    """Ends a step of the one-unit runtime with zero gradients."""
    rt.push_grads("a", torch.zeros(1000))
    rt.finish_step()


def test_fetch_shares_the_pinned_copy_without_a_copy():
    rt, init = one_unit()
    rt.begin_step(1, 0.0)
    with rt.fetch("a", "forward", writable=True) as t:
        assert t.shape == (1000,) and t.dtype == torch.float32 and t.device.type == "cpu"
        assert torch.equal(t, init)
        fetched_again = rt.fetch("a", "forward")
        # Two fetches of a pinned unit: one buffer, the same address. (A read fetch's tensor
        # refuses data_ptr(), the mutable accessor; its borrowed DLPack export does not.)
        borrowed = torch.from_dlpack(fetched_again)
        assert borrowed.data_ptr() == t.data_ptr()
        del borrowed
        fetched_again.release()
        t.fill_(3.0)  # a write through the torch tensor ...
    with rt.fetch("a", "forward") as t:
        assert torch.all(t == 3.0)  # ... is what the runtime holds and hands out next
    finish(rt)


def test_borrowed_dlpack_export_is_the_same_memory():
    rt, _ = one_unit()
    rt.begin_step(1, 0.0)
    f = rt.fetch("a", writable=True)
    t = f.tensor()
    borrowed = torch.from_dlpack(f)
    assert borrowed.data_ptr() == t.data_ptr()
    f.release()
    # The borrowed export keeps the unit pinned until it is freed.
    assert f.released and f.pinned
    del borrowed
    assert not f.pinned
    finish(rt)


def test_a_released_tensor_cannot_be_read():
    rt, _ = one_unit()
    rt.begin_step(1, 0.0)
    with rt.fetch("a") as t:
        view = t[10:20]
        assert float(view.sum()) == sum(range(10, 20))
    for use in (lambda: t.sum(), lambda: t[0].item(), lambda: view.clone(), lambda: t + 1, lambda: t.numpy()):
        with pytest.raises(RuntimeError, match="released"):
            use()
    f = rt.fetch("a")
    f.release()
    with pytest.raises(oogc.UsageError, match="released"):
        f.tensor()
    finish(rt)


def test_a_read_fetch_refuses_in_place_writes():
    rt, _ = one_unit()
    rt.begin_step(1, 0.0)
    with rt.fetch("a") as t:
        with pytest.raises(RuntimeError):
            t.add_(1.0)
    finish(rt)


def test_rust_errors_become_python_exceptions_with_their_messages():
    with pytest.raises(oogc.ConfigError, match="budgets"):
        oogc.Runtime({"budgets": {"gpu": "1 MiB", "bogus": 1}})
    with pytest.raises(oogc.ConfigError, match="nvme_dirs"):
        oogc.Runtime({"budgets": {"gpu": "1 MiB", "optimizer_state": "nvme"}})
    # The sim device is the target of this build; a CUDA device is refused by name.
    with pytest.raises(oogc.DeviceError, match="CUDA"):
        oogc.Runtime({"device": {"kind": "cuda:0"}, "budgets": {"gpu": "1 MiB"}})
    rt, _ = one_unit()
    with pytest.raises(oogc.UsageError, match='no unit named "b"'):
        rt.fetch("b")
    with pytest.raises(oogc.UsageError, match="init has 3 elements"):
        rt.add_unit("c", 4, torch.zeros(3))
    with pytest.raises(oogc.UsageError, match="float32"):
        rt.add_unit("c", 4, torch.zeros(4, dtype=torch.float64))
    rt.begin_step(1, 0.0)
    with pytest.raises(oogc.UsageError, match="expected 1000|1000"):
        rt.push_grads("a", torch.zeros(999))
    assert issubclass(oogc.OutOfMemoryError, oogc.OogcError)
    small = oogc.Runtime({"budgets": {"gpu": 1024}})
    small.add_unit("big", 4096)
    with pytest.raises(oogc.OutOfMemoryError) as e:
        small.begin_step(1, 0.0)
    assert "bytes" in str(e.value)


def test_state_dict_round_trip(tmp_path):
    cfg = {
        "budgets": {"gpu": "1 MiB", "optimizer_state": "nvme", "nvme_dirs": [str(tmp_path)], "nvme_size": "16 MiB"},
        "optimizer": {"clip_norm": 0.0},
    }
    rt = oogc.Runtime(cfg)
    rt.add_unit("a", 100, torch.ones(100))
    for step in (1, 2):
        rt.begin_step(step, 0.1)
        with rt.fetch("a"):
            pass
        with rt.fetch("a", "backward"):
            rt.push_grads("a", torch.full((100,), 0.5))
        stats = rt.finish_step()
        assert stats["step"] == step and not stats["skipped"]
    sd = rt.state_dict()
    assert sd["step"] == 2 and set(sd["units"]["a"]) == {"master", "exp_avg", "exp_avg_sq"}
    assert torch.all(sd["units"]["a"]["master"] < 1.0)
    (tmp_path / "b").mkdir()
    other = oogc.Runtime(cfg | {"budgets": cfg["budgets"] | {"nvme_dirs": [str(tmp_path / "b")]}})
    other.add_unit("a", 100)
    other.load_state_dict(sd)
    assert other.step == 2
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(other.state_dict()["units"]["a"][key], sd["units"]["a"][key])


def test_config_from_a_toml_file(tmp_path):
    path = tmp_path / "oogc.toml"
    path.write_text('[budgets]\ngpu = "2 MiB"\n[optimizer]\nbetas = [0.9, 0.999]\n')
    rt = oogc.Runtime(str(path))
    rt.add_unit("x", 10)
    assert rt.units == [("x", 10)]
