"""Kernel launches of the GPU serving device (mdsl.serving.gpu) and its Hopper linears (mdsl.serving.gpu_wgmma):
on sm_90 and later each kernel of a step is launched allowed to start while the kernel before it ends
(programmatic dependent launch; dependent_launch.cuh says what each kernel does for it)."""
from __future__ import annotations

import ctypes


def dependent_launch(driver, stream):
    """A launch configuration on `stream` whose kernels may start while the kernel before them ends
    (programmatic stream serialization: dependent_launch.cuh's step_wait orders what they touch); its grid,
    block and shared memory are set per launch (launch_kernel)."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.attrs = [attribute]
    config.numAttrs = 1
    config.hStream = stream
    config.blockDimY = config.blockDimZ = 1
    return config


def launch_kernel(dev, function, name: str, grid: tuple, block: int, smem: int, args: list) -> None:
    """Launch `function` on the device's stream, through its dependent_launch configuration where it has one;
    then the device's on_launch(name), where set."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    config, d = dev.dependent_launch, dev._driver
    if config is None:
        result = d.cuLaunchKernel(function, gx, gy, gz, block, 1, 1, smem, dev._stream, ctypes.addressof(params), 0)
    else:
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.sharedMemBytes = block, smem
        result = d.cuLaunchKernelEx(config, function, ctypes.addressof(params), 0)
    dev._check(result, f"launching {name}")
    if dev.on_launch is not None:
        dev.on_launch(name)
