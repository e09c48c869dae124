"""build_order / parse_rank_id: tables for the refusals, properties for the round trip."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nicswitch_agent import InvalidOrder, SwitchOrder
from nicswitch_agent.orders import MAX_RANK_DIGITS, build_order, parse_rank_id

CANONICAL = re.compile(rf"0|[1-9][0-9]{{0,{MAX_RANK_DIGITS - 1}}}")


def order(rank_ids: list[str], ops: list[Any], *, world_size: int = 1 << 30, max_ranks: int = 1 << 20,
          seq: int = 1, job_id: str = "job-1") -> SwitchOrder:
    return build_order(seq=seq, job_id=job_id, rank_ids=rank_ids, ops=ops, world_size=world_size,
                       max_ranks=max_ranks)


# -- parse_rank_id ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rank"),
    [("0", 0), ("1", 1), ("7", 7), ("10", 10), ("4095", 4095), ("123456789", 123456789), ("999999999", 999999999)],
)
def test_canonical_decimals_accepted(text: str, rank: int) -> None:
    got = parse_rank_id(text, 0)
    assert got == rank
    assert type(got) is int


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is empty"),
        ("-1", "is not a plain decimal rank id"),
        ("+3", "is not a plain decimal rank id"),
        (" 3", "is not a plain decimal rank id"),
        ("3 ", "is not a plain decimal rank id"),
        ("3\n", "is not a plain decimal rank id"),
        ("1e9", "is not a plain decimal rank id"),
        ("1.0", "is not a plain decimal rank id"),
        ("0x1", "is not a plain decimal rank id"),
        ("1_000", "is not a plain decimal rank id"),
        ("\u0663", "is not a plain decimal rank id"),  # ARABIC-INDIC DIGIT THREE
        ("\uff13", "is not a plain decimal rank id"),  # FULLWIDTH DIGIT THREE
        ("\u00b2", "is not a plain decimal rank id"),  # SUPERSCRIPT TWO (isdigit() is True)
        ("1\u0663", "is not a plain decimal rank id"),
        ("three", "is not a plain decimal rank id"),
        ("007", "has a leading zero"),
        ("00", "has a leading zero"),
        ("01", "has a leading zero"),
        ("1000000000", "is too long"),  # 10 digits: more than any rank table has
        ("9" * 64, "is too long"),
    ],
)
def test_non_canonical_rank_ids_refused(text: str, why: str) -> None:
    with pytest.raises(InvalidOrder, match=re.escape(why)) as info:
        parse_rank_id(text, 5)
    message = str(info.value)
    assert message.startswith("rankID[5]=")
    assert repr(text[:16]) in message


def test_overlong_rank_id_is_truncated_in_the_message() -> None:
    with pytest.raises(InvalidOrder) as info:
        parse_rank_id("1" * 10_000, 3)
    message = str(info.value)
    assert message == f"rankID[3]={'1' * 16!r}... is too long"


@pytest.mark.parametrize("value", [None, 3, b"3"])
def test_non_string_rank_ids_refused(value: Any) -> None:
    with pytest.raises(InvalidOrder, match=re.escape(f"rankID[0]={value!r}")):
        parse_rank_id(value, 0)


def test_invalid_order_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_rank_id("x", 0)


# -- build_order tables -------------------------------------------------------------------------


def test_order_preserved_exactly() -> None:
    got = order(["7", "0", "3", "12", "1"], [True, False, False, True, True], seq=4, job_id="uid")
    assert got.ranks == (7, 0, 3, 12, 1)
    assert got.ops == (True, False, False, True, True)
    assert (got.seq, got.job_id) == (4, "uid")
    assert list(got) == [(7, True), (0, False), (3, False), (12, True), (1, True)]
    assert len(got) == 5
    assert not got.empty


def test_empty_list_is_a_valid_empty_order() -> None:
    got = order([], [])
    assert got.empty
    assert (got.ranks, got.ops) == ((), ())
    assert got.summary() == "#1 0 rank(s): (none)"


@pytest.mark.parametrize(
    ("ops", "expected"),
    [([1, 0], (True, False)), (["x", ""], (True, False)), ([True, False], (True, False)),
     ([2, None], (True, False))],
)
def test_ops_mapped_to_bools(ops: list[Any], expected: tuple[bool, ...]) -> None:
    got = order(["1", "2"], ops)
    assert got.ops == expected
    assert all(type(op) is bool for op in got.ops)


@pytest.mark.parametrize(
    ("rank_ids", "ops", "message"),
    [
        (["1", "2"], [True], "rankID has 2 entries but op has 1"),
        (["1"], [True, False], "rankID has 1 entries but op has 2"),
        ([], [True], "rankID has 0 entries but op has 1"),
        (["1"], [], "rankID has 1 entries but op has 0"),
    ],
)
def test_mismatched_lengths_refused(rank_ids: list[str], ops: list[bool], message: str) -> None:
    with pytest.raises(InvalidOrder, match=re.escape(message)):
        order(rank_ids, ops)


@pytest.mark.parametrize(
    ("rank_ids", "index", "value"),
    [
        (["1", "2", "1"], 2, 1),
        (["0", "0"], 1, 0),
        (["5", "6", "7", "6", "5"], 3, 6),
    ],
)
def test_duplicate_ranks_refused(rank_ids: list[str], index: int, value: int) -> None:
    with pytest.raises(InvalidOrder) as info:
        order(rank_ids, [True] * len(rank_ids))
    assert str(info.value) == f"rankID[{index}]={value} is listed more than once"


def test_same_rank_with_conflicting_ops_refused() -> None:
    with pytest.raises(InvalidOrder, match=re.escape("rankID[1]=3 is listed more than once")):
        order(["3", "3"], [True, False])


@pytest.mark.parametrize(
    ("rank_ids", "world_size", "index", "value"),
    [(["0", "8"], 8, 1, 8), (["9", "1"], 8, 0, 9), (["1"], 1, 0, 1), (["123456789"], 16, 0, 123456789)],
)
def test_ranks_outside_world_size_refused(rank_ids: list[str], world_size: int, index: int, value: int) -> None:
    with pytest.raises(InvalidOrder) as info:
        order(rank_ids, [False] * len(rank_ids), world_size=world_size)
    assert str(info.value) == f"rankID[{index}]={value} is outside the job (world_size={world_size})"


def test_ranks_below_world_size_accepted() -> None:
    assert order(["0", "7"], [True, True], world_size=8).ranks == (0, 7)
    assert order(["100"], [True], world_size=101).ranks == (100,)


@pytest.mark.parametrize("world_size", [None, 0, -1, True, 2.0])
def test_an_unknown_world_size_refuses_every_list(world_size: Any) -> None:
    """No "world size unknown, anything goes": a one-process job is a world of one."""
    with pytest.raises(InvalidOrder, match="the job's size must be known"):
        order(["0"], [True], world_size=world_size)


@pytest.mark.parametrize(
    ("n_ranks", "n_ops"), [(5, 5), (5, 4), (4, 5), (5, 0)],
)
def test_oversized_lists_refused(n_ranks: int, n_ops: int) -> None:
    with pytest.raises(InvalidOrder) as info:
        order([str(i) for i in range(n_ranks)], [True] * n_ops, max_ranks=4)
    assert str(info.value) == f"list too large: {max(n_ranks, n_ops)} entries, limit max_ranks=4"


def test_list_at_max_ranks_accepted() -> None:
    assert len(order(["0", "1", "2", "3"], [True] * 4, max_ranks=4)) == 4


def test_size_is_checked_before_the_entries() -> None:
    # A huge list is refused on its size alone, without parsing every id.
    with pytest.raises(InvalidOrder, match="list too large"):
        order(["bad"] * 10, [True] * 10, max_ranks=3)


def test_bad_rank_id_message_names_its_index() -> None:
    with pytest.raises(InvalidOrder) as info:
        order(["0", "1", "007", "3"], [True] * 4)
    assert str(info.value) == "rankID[2]='007' has a leading zero (ClusterD never writes one)"


@pytest.mark.parametrize(
    ("rank_ids", "first_bad"),
    [(["1", "-1", "x"], "rankID[1]='-1'"), (["", "1"], "rankID[0]=''"), (["0", "1", " 2"], "rankID[2]=' 2'")],
)
def test_first_bad_rank_id_is_reported(rank_ids: list[str], first_bad: str) -> None:
    with pytest.raises(InvalidOrder, match=re.escape(first_bad)):
        order(rank_ids, [True] * len(rank_ids))


def test_switch_order_refuses_mismatched_tuples() -> None:
    with pytest.raises(InvalidOrder, match=r"ranks \(2\) and ops \(1\) differ in length"):
        SwitchOrder(seq=1, job_id="j", ranks=(1, 2), ops=(True,))


def test_summary_and_partition_table() -> None:
    got = order(["2", "3", "0", "5"], [True, False, True, False], seq=3)
    assert got.to_standby() == (2, 0)
    assert got.to_primary() == (3, 5)
    assert got.summary() == "#3 4 rank(s): 2->standby 3->primary 0->standby 5->primary"
    assert got.summary(limit=2) == "#3 4 rank(s): 2->standby 3->primary (+2 more)"
    assert got.as_dict() == {"seq": 3, "job_id": "job-1", "ranks": [2, 3, 0, 5], "ops": [True, False, True, False]}


def test_orders_compare_by_content_not_receive_time() -> None:
    assert order(["1"], [True]) == order(["1"], [True])
    assert order(["1"], [True]) != order(["1"], [False])


# -- properties ---------------------------------------------------------------------------------

rank_lists = st.lists(st.integers(min_value=0, max_value=10**MAX_RANK_DIGITS - 1), unique=True, max_size=64)


@st.composite
def ranks_and_ops(draw: st.DrawFn) -> tuple[list[int], list[bool]]:
    ranks = draw(rank_lists)
    ops = draw(st.lists(st.booleans(), min_size=len(ranks), max_size=len(ranks)))
    return ranks, ops


@given(ranks_and_ops())
def test_build_order_round_trips_exactly(data: tuple[list[int], list[bool]]) -> None:
    ranks, ops = data
    got = order([str(r) for r in ranks], ops)
    assert got.ranks == tuple(ranks)
    assert got.ops == tuple(ops)
    assert got.as_dict()["ranks"] == ranks
    assert got.as_dict()["ops"] == ops
    # with world_size just large enough, it is still accepted unchanged
    sized = order([str(r) for r in ranks], ops, world_size=max(ranks, default=0) + 1, max_ranks=max(len(ranks), 1))
    assert (sized.ranks, sized.ops) == (got.ranks, got.ops)


@given(st.integers(min_value=0, max_value=10**MAX_RANK_DIGITS - 1))
def test_every_rank_in_range_parses_from_its_decimal(rank: int) -> None:
    assert parse_rank_id(str(rank), 0) == rank


def _not_canonical(text: str) -> bool:
    return CANONICAL.fullmatch(text) is None


non_canonical = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1),  # digits of every script
    st.from_regex(r"[+\- 0\t]?[0-9]{1,12}[ \n_.eE]?", fullmatch=True),
    st.integers(min_value=10**MAX_RANK_DIGITS).map(str),
).filter(_not_canonical)


@given(non_canonical, st.integers(min_value=0, max_value=10**6))
def test_non_canonical_text_raises_invalid_order_only(text: str, index: int) -> None:
    with pytest.raises(InvalidOrder) as info:
        parse_rank_id(text, index)
    assert str(info.value).startswith(f"rankID[{index}]=")
    assert repr(text[:16])[:-1] in str(info.value)  # the value (possibly truncated) is named


@given(st.text(), st.integers(min_value=0, max_value=100))
def test_parse_rank_id_accepts_exactly_the_canonical_form(text: str, index: int) -> None:
    try:
        rank = parse_rank_id(text, index)
    except InvalidOrder:
        assert _not_canonical(text)
    else:
        assert not _not_canonical(text)
        assert str(rank) == text


@given(st.lists(st.one_of(st.text(max_size=12), st.integers(0, 50).map(str)), max_size=8), st.data())
def test_build_order_never_raises_anything_but_invalid_order(rank_ids: list[str], data: st.DataObject) -> None:
    ops = data.draw(st.lists(st.booleans(), max_size=10))
    world_size = data.draw(st.integers(1, 60))
    try:
        got = order(rank_ids, ops, world_size=world_size, max_ranks=8)
    except InvalidOrder as exc:
        assert str(exc)
    else:
        assert [str(r) for r in got.ranks] == rank_ids
        assert len(set(got.ranks)) == len(got.ranks)
        assert all(r < world_size for r in got.ranks)


@given(ranks_and_ops(), st.integers(min_value=0, max_value=80))
def test_standby_and_primary_partition_the_ranks(data: tuple[list[int], list[bool]], limit: int) -> None:
    ranks, ops = data
    got = order([str(r) for r in ranks], ops)
    standby, primary = got.to_standby(), got.to_primary()
    assert set(standby).isdisjoint(primary)
    assert sorted(standby + primary) == sorted(ranks)
    # each side keeps the received order
    assert list(standby) == [r for r, op in zip(ranks, ops, strict=True) if op]
    assert list(primary) == [r for r, op in zip(ranks, ops, strict=True) if not op]
    # summary names each listed rank with its side, in order, and counts the rest
    text = got.summary(limit=limit)
    assert text.startswith(f"#1 {len(ranks)} rank(s): ")
    shown = re.findall(r"(\d+)->(standby|primary)", text)
    assert shown == [(str(r), "standby" if op else "primary") for r, op in list(zip(ranks, ops, strict=True))[:limit]]
    if len(ranks) > limit:
        assert text.endswith(f" (+{len(ranks) - limit} more)")
    else:
        assert "more)" not in text


@given(st.lists(st.integers(min_value=0, max_value=4096), max_size=64), st.integers(min_value=1, max_value=16),
       st.integers(min_value=0, max_value=300))
def test_a_nodes_local_ranks_are_the_listed_ranks_on_that_node_in_the_orders_order(
        ranks: list[int], per_node: int, node: int) -> None:
    from nicswitch_agent.orders import RankMap

    order = SwitchOrder(seq=1, job_id="j", ranks=tuple(ranks), ops=tuple(r % 2 == 0 for r in ranks))
    expected = tuple(r for r in ranks if r // per_node == node)
    assert RankMap(per_node, node).local_ranks(order) == expected
