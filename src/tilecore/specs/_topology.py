"""Where the tables live: devices and logical SparseCores."""

from __future__ import annotations

import dataclasses

from ._numbers import make_plain

DEFAULT_AXIS = "sparsecore"
"""The name of the device mesh axis tables and batches are split over, unless a call names
another (`tilecore.ops`, `tilecore.distributed`, the layers and pipelining)."""


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """Devices and logical SparseCores every table is mod-sharded over.

    Attributes:
      global_devices: JAX devices over all processes.
      sc_per_device: logical SparseCores per device (a power of two; 4 on TPU v5p).
      local_devices: devices of this process; defaults to `global_devices`
        (single process). Each process preprocesses rows for its local devices.
    """

    global_devices: int = 1
    sc_per_device: int = 4
    local_devices: int | None = None

    def __post_init__(self) -> None:
        make_plain(self, "global_devices", "sc_per_device", "local_devices")
        for field in ("global_devices", "sc_per_device"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology: {field} must be an integer >= 1, got {value!r}.")
        if not _is_power_of_two(self.sc_per_device):
            raise ValueError(
                f"Topology: sc_per_device must be a power of two, got {self.sc_per_device}."
            )
        if not _is_power_of_two(self.num_partitions):
            raise ValueError(
                "Topology: global_devices × sc_per_device must be a power of two, got "
                f"{self.global_devices} × {self.sc_per_device} = {self.num_partitions}."
            )
        local = self.global_devices if self.local_devices is None else self.local_devices
        if isinstance(local, bool) or not isinstance(local, int) or local < 1 or (
            self.global_devices % local
        ):
            raise ValueError(
                f"Topology: local_devices must divide global_devices={self.global_devices}, "
                f"got local_devices={self.local_devices!r}."
            )
        object.__setattr__(self, "local_devices", local)

    @property
    def num_local_devices(self) -> int:
        """Devices of this process (never None after construction)."""
        assert self.local_devices is not None
        return self.local_devices

    @property
    def num_partitions(self) -> int:
        """N = global devices × SparseCores per device: shards of every table."""
        return self.global_devices * self.sc_per_device

    @property
    def num_processes(self) -> int:
        """Processes sharing the devices (global ÷ local)."""
        return self.global_devices // self.num_local_devices

    def __str__(self) -> str:
        local = "" if self.num_processes == 1 else f", local {self.local_devices}"
        return f"{self.global_devices}x{self.sc_per_device}{local}"
