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


def test_dlpack_device_is_the_units_and_device_gradients_go_through_cpu():
    """The sim device's units are kDLCPU memory (a CUDA runtime's are kDLCUDA: not testable
    here). A gradient whose DLPack device is kDLCUDA is read through its ``.cpu()``: this checks
    that dispatch with a stand-in producer, not a GPU."""
    rt, _ = one_unit()
    rt.begin_step(1, 0.0)
    with rt.fetch("a"):
        f = rt.fetch("a")
        assert f.__dlpack_device__() == (1, 0)
        with pytest.raises(oogc.UsageError, match=r"DLPack device \(1, 0\), not \(2, 0\)"):
            f.__dlpack__(dl_device=(2, 0))
        f.release()

    class DeviceGrads:
        """Reports kDLCUDA; its ``cpu()`` is the host copy (what a CUDA torch tensor's is)."""

        def __init__(self, host):
            self.host = host
            self.copied = False

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **_):
            raise AssertionError("a device tensor is not read in place")

        def cpu(self):
            self.copied = True
            return self.host

    grads = DeviceGrads(torch.zeros(1000))
    rt.push_grads("a", grads)
    assert grads.copied
    rt.finish_step()


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


# Mixed precision: the compute dtype, DLPack in bf16 and f16, gradients in any float dtype.


def bf16_runtime(**config):
    return oogc.Runtime({"budgets": {"gpu": "1 MiB"}, "optimizer": {"clip_norm": 0.0}, **config})


def test_a_bf16_runtime_shares_bf16_unit_tensors():
    rt = bf16_runtime(compute_dtype="bf16")
    assert rt.compute_dtype == "bf16"
    # Values that bf16 cannot hold: the compute copy is them rounded to nearest even.
    init = 1.0 + torch.arange(1000, dtype=torch.float32) * 2.0**-12
    rt.add_unit("a", 1000, init)
    rt.begin_step(1, 0.0)
    with rt.fetch("a", "forward", writable=True) as t:
        assert t.dtype == torch.bfloat16 and t.shape == (1000,) and t.device.type == "cpu"
        assert torch.equal(t, init.to(torch.bfloat16))
        f = rt.fetch("a")
        assert f.dtype == "bf16" and f.numel == 1000
        # The borrowed DLPack export: kDLBfloat, 16 bits, the same memory.
        borrowed = torch.from_dlpack(f)
        assert borrowed.dtype == torch.bfloat16 and borrowed.data_ptr() == t.data_ptr()
        del borrowed
        f.release()
        t.fill_(3.0)
    with rt.fetch("a", "backward") as t:
        assert torch.all(t == 3.0)
    rt.push_grads("a", torch.zeros(1000, dtype=torch.bfloat16))
    stats = rt.finish_step()
    # The gradients crossed the link in bf16: two bytes each.
    assert stats["d2h_bytes"] == 2 * 1000
    # The master weights stay fp32, exactly the init.
    master, _, _ = rt.unit_state("a")
    assert master.dtype == torch.float32 and torch.equal(master, init)


def test_bf16_gradients_are_pushed_as_bf16_and_others_converted():
    """A bf16 runtime sends 2 bytes per gradient whatever the dtype pushed (f32 is rounded to
    bf16 first); an f32 runtime 4, and a bf16 gradient pushed to it is up-cast exactly. The
    update (lr 1e-2, one Adam step: each element moves by lr times the sign of its gradient, as
    m̂ / sqrt(v̂) = g / |g|) follows the gradient's sign in both."""
    g = torch.linspace(-1, 1, 1000)  # (an even count: no element is 0)
    for dtype, bytes_per in (("bf16", 2), ("f32", 4)):
        for pushed in (torch.float32, torch.bfloat16, torch.float16):
            rt = bf16_runtime(compute_dtype=dtype, optimizer={"clip_norm": 0.0, "weight_decay": 0.0})
            rt.add_unit("a", 1000, torch.ones(1000))
            rt.begin_step(1, 1e-2)
            with rt.fetch("a"):
                pass
            with rt.fetch("a", "backward"):
                rt.push_grads("a", g.to(pushed))
            stats = rt.finish_step()
            assert stats["d2h_bytes"] == bytes_per * 1000, (dtype, pushed)
            master, _, _ = rt.unit_state("a")
            torch.testing.assert_close(master, 1.0 - 1e-2 * torch.sign(g), rtol=0, atol=1e-6)


def test_an_f16_runtime_shares_f16_unit_tensors():
    rt = bf16_runtime(compute_dtype="float16")
    assert rt.compute_dtype == "f16"
    init = torch.linspace(-2, 2, 64)
    rt.add_unit("a", 64, init.to(torch.float16))  # an f16 init: the masters are it up-cast
    rt.begin_step(1, 0.0)
    with rt.fetch("a") as t:
        assert t.dtype == torch.float16 and torch.equal(t, init.to(torch.float16))
    with rt.fetch("a", "backward"):
        rt.push_grads("a", torch.zeros(64, dtype=torch.float16))
    assert rt.finish_step()["d2h_bytes"] == 2 * 64
    assert torch.equal(rt.unit_state("a")[0], init.to(torch.float16).float())


def test_compute_dtype_config_and_default():
    assert bf16_runtime().compute_dtype == "f32"
    assert bf16_runtime(compute_dtype="bfloat16").compute_dtype == "bf16"
    # The default applies only where the config does not say.
    assert oogc.Runtime({"budgets": {"gpu": "1 MiB"}}, default_compute_dtype="bf16").compute_dtype == "bf16"
    assert oogc.Runtime({"budgets": {"gpu": "1 MiB"}, "compute_dtype": "f32"}, default_compute_dtype="bf16").compute_dtype == "f32"
    with pytest.raises(oogc.ConfigError, match="compute_dtype"):
        bf16_runtime(compute_dtype="f64")
    with pytest.raises(oogc.ConfigError, match="compute_dtype"):
        oogc.Runtime({"budgets": {"gpu": "1 MiB"}}, default_compute_dtype="int8")
    with pytest.raises(oogc.ConfigError, match="device.ops"):
        oogc.Runtime({"device": {"ops": "composed"}, "budgets": {"gpu": "1 MiB"}})


def test_compute_dtype_from_a_toml_file(tmp_path):
    path = tmp_path / "oogc.toml"
    path.write_text('compute_dtype = "bf16"\n[budgets]\ngpu = "2 MiB"\n')
    assert oogc.Runtime(str(path)).compute_dtype == "bf16"


def test_dtype_errors_name_the_dtype():
    rt = bf16_runtime(compute_dtype="bf16")
    rt.add_unit("a", 10)
    with pytest.raises(oogc.UsageError, match="expected float32, bfloat16 or float16, got float64"):
        rt.add_unit("b", 10, torch.zeros(10, dtype=torch.float64))
    # Master weights and moments are fp32, whatever the compute dtype.
    z = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(oogc.UsageError, match=r"master: expected float32, got bfloat16"):
        rt.load_unit_state("a", z, z.float(), z.float())
    rt.begin_step(1, 0.0)
    with pytest.raises(oogc.UsageError, match="got int64"):
        rt.push_grads("a", torch.zeros(10, dtype=torch.int64))
    with pytest.raises(oogc.UsageError, match="10"):
        rt.push_grads("a", torch.zeros(9, dtype=torch.bfloat16))
