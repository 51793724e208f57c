"""How much host memory is free to use: /proc/meminfo's MemAvailable (page cache counts as
reclaimable), or effectively unlimited where it cannot be read."""

from pathlib import Path


def host_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62
