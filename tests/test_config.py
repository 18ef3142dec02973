"""GPUMEM_CONF parsing: validated in the core, so the same errors arise with or without a GPU."""
import pytest

from gpumem import _C, parse_config


def test_defaults():
    assert parse_config("") == {"upstream": "auto", "cap_bytes": 0, "cap_fraction": 0.0,
                                "release": "lazy", "release_slack": 0.005,
                                "page_size": _C.DEFAULT_PAGE_SIZE, "gc_on_oom": False, "ipc": True,
                                "stitch": True, "stitch_slack": 0.01,
                                "ends_by_page": False, "early_ends_by_page": 0.1, "park_lent": True}


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("upstream:vmm", "upstream", "vmm"),
        ("upstream=segments", "upstream", "segments"),
        ("cap:0.9", "cap_fraction", 0.9),
        ("cap:1.0", "cap_fraction", 1.0),
        ("cap:40GiB", "cap_bytes", 40 << 30),
        ("cap: 512 MiB", "cap_bytes", 512 << 20),
        ("cap:1073741824", "cap_bytes", 1 << 30),
        ("release:lazy", "release", "lazy"),
        ("gc_on_oom:false", "gc_on_oom", False),
        ("ipc:false", "ipc", False),
        ("ipc:On", "ipc", True),
        ("stitch:true", "stitch", True),
        ("stitch:0", "stitch", False),
        ("release_slack:0", "release_slack", 0.0),
        ("stitch_slack:0.02", "stitch_slack", 0.02),
        ("ends_by_page:true", "ends_by_page", True),
        ("ends_by_page:off", "ends_by_page", False),
        ("early_ends_by_page:0", "early_ends_by_page", 0.0),
        ("early_ends_by_page:0.25", "early_ends_by_page", 0.25),
        ("park_lent:true", "park_lent", True),
        ("park_lent:no", "park_lent", False),
        ("page_size:16MiB", "page_size", 16 << 20),
        (" Upstream : VMM , , release:high_water", "upstream", "vmm"),
    ],
)
def test_accepted(text, key, value):
    assert parse_config(text)[key] == value


@pytest.mark.parametrize(
    "text, words",
    [
        ("bogus:1", "unknown key 'bogus'; accepted keys: upstream, cap, release, release_slack, page_size, gc_on_oom, ipc, stitch, stitch_slack, ends_by_page, early_ends_by_page, park_lent"),
        ("park_lent:often", "park_lent='often' is not valid; accepted: true, false"),
        ("ends_by_page:sometimes", "ends_by_page='sometimes' is not valid; accepted: true, false"),
        ("release_slack:2", "release_slack='2' is not valid"),
        ("early_ends_by_page:1.5", "early_ends_by_page='1.5' is not valid; accepted: a fraction in [0, 1] such as 0.1"),
        ("early_ends_by_page:often", "early_ends_by_page='often' is not valid"),
        ("page_size:3MiB", "page_size='3MiB' is not valid; accepted: a multiple of 2MiB"),
        ("upstream:cuda", "upstream='cuda' is not valid; accepted: auto, vmm, segments"),
        ("cap:1.5", "cap='1.5' is not valid"),
        ("cap:0.0", "cap='0.0' is not valid"),
        ("cap:-3GiB", "cap='-3GiB' is not valid"),
        ("cap:12parsecs", "cap='12parsecs' is not valid"),
        ("release:sometimes", "accepted: lazy, high_water"),
        ("gc_on_oom:maybe", "accepted: true, false"),
        ("ipc:sometimes", "ipc='sometimes' is not valid; accepted: true, false"),
        ("stitch:often", "stitch='often' is not valid; accepted: true, false"),
        ("upstream", "is not key:value"),
    ],
)
def test_rejected_with_the_key_and_accepted_values(text, words):
    with pytest.raises(ValueError) as e:
        parse_config(text)
    assert words in str(e.value)
    assert str(e.value).startswith("GPUMEM_CONF:")


def test_parse_size():
    assert _C.parse_size("1.5KiB") == 1536
    assert _C.parse_size("2 GB") == 2_000_000_000
    with pytest.raises(ValueError, match="unknown unit"):
        _C.parse_size("3 furlongs")
