"""Folded host notation: expand, fold, HostSet."""

from __future__ import annotations

import random

import pytest

from corral.hostrange import MAX_HOSTS, HostRangeError, HostSet, expand, fold, split_list

# ---------------------------------------------------------------- expand


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("a,b[1-2]", ["a", "b1", "b2"]),
        ("gpu-[01-03,05],cpu1", ["gpu-01", "gpu-02", "gpu-03", "gpu-05", "cpu1"]),
        ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
        ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ("[1-2]x", ["1x", "2x"]),
        ("plain", ["plain"]),
        ("n[5,1]", ["n5", "n1"]),  # written order is kept
        ("n[1-2,2]", ["n1", "n2", "n2"]),  # duplicates kept for the reader to report
        (" a , b ", ["a", "b"]),
    ],
)
def test_expand(text: str, names: list[str]) -> None:
    assert expand(text) == names


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("node[3-1]", "backwards"),
        ("node[1-", "never closed"),
        ("node[a-b]", "bad range"),
        ("node[1-2-3]", "bad range"),
        ("node[-3]", "bad range"),
        ("", "empty host list"),
        ("   ", "empty host list"),
        ("node[]", "empty brackets"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        ("node]", "without a matching"),
        ("node[[1]]", "nested"),
        ("node[1-05]", "zero-padding"),
        ("node[1-99999999]", str(MAX_HOSTS)),
        ("a[1-300]b[1-300]", str(MAX_HOSTS)),
    ],
)
def test_expand_errors(text: str, words: str) -> None:
    with pytest.raises(HostRangeError, match=words.replace("[", r"\[")) as info:
        expand(text)
    assert isinstance(info.value, ValueError)
    if text.strip():
        assert repr(text) in str(info.value)  # the message quotes the expression


def test_split_list_respects_brackets() -> None:
    assert split_list("a,b[1-2,5],c") == ["a", "b[1-2,5]", "c"]


# ---------------------------------------------------------------- fold


@pytest.mark.parametrize(
    ("names", "folded"),
    [
        (["node1", "node2", "node3", "node5"], "node[1-3,5]"),
        (["node01", "node02", "node03", "node07"], "node[01-03,07]"),
        (["node08", "node09", "node10"], "node[08-10]"),
        (["node9", "node10"], "node[9-10]"),
        (["node1", "node01"], "node1,node01"),
        (["head", "node1", "node2", "login"], "head,node[1-2],login"),
        (["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"], "rack[1-2]-gpu[1-2]"),
        (["rack1-gpu1", "rack1-gpu2", "rack2-gpu1"], "rack1-gpu[1-2],rack2-gpu1"),
        (["n3", "n1", "n2", "n1"], "n[1-3]"),
        (["b2", "a1", "b1"], "b[1-2],a1"),  # groups in order of first appearance
        (["10.0.0.1", "10.0.0.2"], "10.0.0.[1-2]"),
        (["gpu5"], "gpu5"),
        ([], ""),
    ],
)
def test_fold(names: list[str], folded: str) -> None:
    assert fold(names) == folded
    assert set(expand(folded) if folded else []) == set(names)


def _random_name(rng: random.Random) -> str:
    prefix = rng.choice(["node", "gpu-", "rack", "a", "x.y", ""])
    parts = [prefix]
    for _ in range(rng.randint(1, 3)):
        width = rng.choice([0, 0, 2, 3])
        parts.append(str(rng.randint(0, 120)).zfill(width))
        parts.append(rng.choice(["", "-n", "."]))
    name = "".join(parts)
    return name


@pytest.mark.parametrize("seed", range(40))
def test_fold_expand_properties(seed: int) -> None:
    """Seeded property test (hypothesis is not a dependency): folding loses
    no name and adds none, and a folded form is a fixed point."""
    rng = random.Random(seed)
    names = [_random_name(rng) for _ in range(rng.randint(1, 60))]
    folded = fold(names)
    again = expand(folded)
    assert sorted(set(again)) == sorted(set(names))
    assert len(again) == len(set(names))  # no duplicates introduced
    assert fold(again) == folded  # canonical: fold(expand(x)) == x for folded x


@pytest.mark.parametrize(
    "canonical",
    ["node[01-16]", "gpu[1-3,5],login", "rack[1-2]-gpu[01-04]", "a[1-2]b[3,5]c"],
)
def test_round_trip_of_canonical_forms(canonical: str) -> None:
    assert fold(expand(canonical)) == canonical


# ---------------------------------------------------------------- HostSet


def test_hostset_is_ordered_and_prints_folded() -> None:
    hs = HostSet.parse("gpu[03,01-02],gpu01")
    assert list(hs) == ["gpu03", "gpu01", "gpu02"]
    assert len(hs) == 3
    assert "gpu02" in hs and "gpu04" not in hs
    assert str(hs) == "gpu[01-03]"
    assert str(hs - HostSet.parse("gpu02")) == "gpu[01,03]"
    assert str(hs | HostSet.parse("gpu04")) == "gpu[01-04]"
    assert list(hs & HostSet.of(["gpu02", "x"])) == ["gpu02"]


def test_hostset_parse_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        HostSet.parse("gpu[2-1]")


def test_an_expansion_of_long_names_is_refused_before_it_is_built() -> None:
    # 65,536 names of 6,000 characters: 400 MB and seconds before any name check
    with pytest.raises(HostRangeError, match=r"\(6013 characters\): a host name would be longer than 253"):
        expand("x" * 6000 + "[00000-65535]")
    assert len(expand("n" * 240 + "[1-9999]")[-1]) == 244
