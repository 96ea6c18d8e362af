"""mdsl.serving.gpu_launch without a GPU: a launch goes through the device's dependent-launch configuration
(grid, block and shared memory set on it, the programmatic stream serialization attribute on) where the
device has one, else through cuLaunchKernel, and tells the profiling hook once per kernel."""
from __future__ import annotations

import ctypes
import types

import pytest

from mdsl.serving.gpu_launch import dependent_launch, launch_kernel


def _device(config):
    launched, checked, hooked = [], [], []

    def launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        launched.append(("plain", function, (gx, gy, gz), bx, smem, stream))
        return "ok"

    def launch_ex(cfg, function, params, extra):
        launched.append(("dependent", function, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), cfg.blockDimX,
                         cfg.sharedMemBytes, cfg.hStream))
        return "ok"

    driver = types.SimpleNamespace(cuLaunchKernel=launch, cuLaunchKernelEx=launch_ex)
    dev = types.SimpleNamespace(_driver=driver, _stream=7, dependent_launch=config, on_launch=hooked.append,
                                _check=lambda result, what: checked.append((result, what)))
    return dev, launched, checked, hooked


def test_without_a_configuration_a_kernel_is_launched_plainly_and_hooked_once():
    dev, launched, checked, hooked = _device(None)
    launch_kernel(dev, "f", "rms_norm_bf16", (3,), 256, 0, [ctypes.c_int(1)])
    launch_kernel(dev, "g", "attention_mma_4_bf16", (2, 8, 4), 128, 1024, [ctypes.c_int(1), ctypes.c_float(2.0)])
    assert launched == [("plain", "f", (3, 1, 1), 256, 0, 7), ("plain", "g", (2, 8, 4), 128, 1024, 7)]
    assert checked == [("ok", "launching rms_norm_bf16"), ("ok", "launching attention_mma_4_bf16")]
    assert hooked == ["rms_norm_bf16", "attention_mma_4_bf16"]


def test_a_dependent_launch_sets_each_launchs_grid_on_the_configuration():
    driver = pytest.importorskip("cuda.bindings.driver")
    config = dependent_launch(driver, 7)
    assert config.numAttrs == 1
    attribute = config.attrs[0]
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1
    dev, launched, _, hooked = _device(config)
    launch_kernel(dev, "f", "linear_wgmma_bf16_8", (1, 48, 5), 384, 115712, [ctypes.c_int(1)])
    launch_kernel(dev, "g", "gather", (4,), 256, 0, [ctypes.c_int(1)])
    assert [entry[:5] for entry in launched] == [("dependent", "f", (1, 48, 5), 384, 115712),
                                                  ("dependent", "g", (4, 1, 1), 256, 0)]
    assert hooked == ["linear_wgmma_bf16_8", "gather"]


def test_the_serving_devices_launches_are_hooked_once_a_kernel():
    from mdsl.serving.gpu import GpuDevice

    dev, launched, _, hooked = _device(None)
    dev._function = lambda name, smem: f"function of {name}"
    GpuDevice.launch(dev, "kv_append_bf16", (5, 8), 256, [ctypes.c_int(1)])
    assert launched == [("plain", "function of kv_append_bf16", (5, 8, 1), 256, 0, 7)]
    assert hooked == ["kv_append_bf16"]
