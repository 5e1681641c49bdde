"""Every committed measurement says where it came from (the course plan: machine, cores, load before and after,
versions, date, command), and one taken under other jobs' load says so in its file.

A figure a notebook renders from notebooks/data/ is only as good as this record: a timing taken at load 25 on 2 cores
teaches noise, so the file must let the notebook print it beside the figure (and mark it).
"""

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "notebooks" / "data"

# Not measurements: what other people published, each row citing its source.
NOT_MEASURED = {"published_layouts.json"}


def records(name: str, data: dict) -> list[tuple[str, dict]]:
    """The measurement records of a file: the file itself, or one per world size (01, 05)."""
    if name == "01_ring_vs_library.json":
        return [(f" runs[{size}]", run) for size, run in data["runs"].items()]
    if name == "05_bubble.json":
        return [(f" [{size}]", run) for size, run in data.items()]
    return [("", data)]


def torch_version(record: dict) -> str | None:
    for place in (record.get("versions", {}), record.get("machine", {})):
        if place.get("torch"):
            return place["torch"]
    return None


def cores(record: dict) -> int | None:
    machine = record.get("machine", {})
    return machine.get("cores") or machine.get("cpu_cores")


MEASURED = sorted(p.name for p in DATA.glob("*.json") if p.name not in NOT_MEASURED)


def test_every_data_file_is_listed():
    assert MEASURED, f"no measurement files in {DATA}"
    assert NOT_MEASURED <= {p.name for p in DATA.glob("*.json")}, "NOT_MEASURED names a file that is gone"


@pytest.mark.parametrize("name", MEASURED)
def test_measurement_records_its_provenance(name):
    data = json.loads((DATA / name).read_text())
    for where, record in records(name, data):
        label = f"notebooks/data/{name}{where}"
        missing = [field for field in ("date", "command") if not (record.get(field) or record["machine"].get(field))]
        missing += [] if torch_version(record) else ["torch version"]
        missing += [] if cores(record) else ["cores"]
        load = record.get("load_average_1min") or record.get("machine", {}).get("load_average_1min")
        if name == "gpu_figures.json":  # one GPU: the CPU load matters little; what was recorded is the load
            missing += [] if load is not None else ["load average"]
        else:
            if not (isinstance(load, dict) and {"before", "after"} <= set(load)):
                missing.append("load average before and after")
            if not isinstance(record.get("loaded"), bool):
                missing.append('"loaded" (true when other jobs shared the cores)')
        assert not missing, f"{label} does not record {', '.join(missing)}: re-measure with its command"
