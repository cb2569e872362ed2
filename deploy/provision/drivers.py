"""Minimum NVIDIA Linux driver per CUDA version, and CUDA binary compatibility of GPU archs. One place.

Source: NVIDIA CUDA Toolkit Release Notes, "CUDA Driver" section -- Table 3 "CUDA Toolkit and
Corresponding Driver Versions" (the driver each toolkit release shipped with, Linux x86_64) and
Table 2 "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility".
PyTorch's CUDA wheels bundle the CUDA runtime (nvidia-cuda-runtime-*) and so rely on minor version
compatibility: below the minor-compatibility minimum the runtime cannot initialise at all (a
blocker); between it and the toolkit's own release driver it runs, but PTX JIT and features new in
that toolkit may fail (a warning).
"""
from __future__ import annotations

from packaging.version import InvalidVersion, Version

# CUDA major.minor -> driver the toolkit's GA release shipped with (Table 3, Linux x86_64).
TOOLKIT_DRIVER = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}
# CUDA major -> minimum driver for minor version compatibility (Table 2, Linux x86_64).
MINOR_COMPAT_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
SOURCE = ("NVIDIA CUDA Toolkit Release Notes: Table 3 (toolkit and corresponding driver versions) and "
          "Table 2 (minimum driver for CUDA minor version compatibility)")


def cuda_from_local(local: str | None) -> str | None:
    """A torch local build tag to its CUDA version: 'cu130' -> '13.0', 'cu128' -> '12.8'."""
    if not local or not local.startswith("cu") or not local[2:].isdigit() or len(local) < 5:
        return None
    digits = local[2:]
    return f"{int(digits[:-1])}.{int(digits[-1])}"


def driver_check(cuda: str | None, driver: str | None) -> tuple[str, str] | None:
    """(level, message) when `driver` is too old for CUDA `cuda`; level is 'blocker' or 'warning'.
    None when it is new enough or either value is unknown."""
    if not cuda or not driver:
        return None
    try:
        cv, dv = Version(cuda), Version(driver)
    except InvalidVersion:
        return None
    family = MINOR_COMPAT_DRIVER.get(cv.major)
    if family is None:
        return ("blocker", f"no minimum driver is known for CUDA {cuda} (table: {SOURCE})")
    if dv < Version(family):
        return ("blocker", f"driver {driver} is older than {family}, the minimum for CUDA {cv.major}.x "
                           f"(the reference torch is built for CUDA {cuda})")
    ga = TOOLKIT_DRIVER.get(f"{cv.major}.{cv.minor}")
    if ga and dv < Version(ga):
        return ("warning", f"driver {driver} runs CUDA {cuda} only through minor version compatibility "
                           f"(CUDA {cuda} shipped with {ga}): PTX JIT and {cuda}-only features may fail")
    return None


def sm_tuple(sm: str) -> tuple[int, int] | None:
    """'sm_120' -> (12, 0); 'sm_90a' -> (9, 0); 'sm_86' -> (8, 6)."""
    digits = "".join(ch for ch in sm.removeprefix("sm_").removeprefix("compute_") if ch.isdigit())
    if len(digits) < 2:
        return None
    return int(digits[:-1]), int(digits[-1])


def arch_supported(gpu_sm: str, arch_list: list[str]) -> bool:
    """Can a build with SASS for `arch_list` run on a `gpu_sm` GPU? CUDA cubins are binary compatible
    with later minor revisions of the same major (sm_80 code runs on sm_86, not on sm_90 or sm_120);
    PTX (compute_XY) is not in torch's sm list and is not relied on here."""
    g = sm_tuple(gpu_sm)
    if g is None:
        return True
    for a in arch_list:
        t = sm_tuple(a)
        if t and t[0] == g[0] and t[1] <= g[1]:
            return True
    return False
