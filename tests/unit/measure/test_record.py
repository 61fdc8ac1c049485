"""The optimization record: one per node, replaced in place, returned as a frozen record."""
import dataclasses

import pytest

from sdopt.measure.record import OptimizationRecord, record


def test_record_files_a_plain_dict_and_returns_the_record():
    records = []
    entry = record(records, "SDOptAttention", "auto", "sdpa", "picked")
    assert entry == OptimizationRecord("SDOptAttention", "auto", "sdpa", "picked")
    assert records == [{"node": "SDOptAttention", "requested": "auto", "active": "sdpa", "note": "picked", "short": ""}]
    assert type(records[0]) is dict
    assert record(records, "SDOptPrecision", "fp16", "fp16").note == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.active = "naive"


def test_same_node_replaces_and_moves_to_the_end_others_stay():
    records = []
    record(records, "A", "1", "1")
    record(records, "B", "2", "2")
    record(records, "C", "3", "3")
    record(records, "A", "1b", "1b", "second")
    assert [(r["node"], r["requested"]) for r in records] == [("B", "2"), ("C", "3"), ("A", "1b")]
    assert records[-1]["note"] == "second"


def test_records_change_in_place():
    records = []
    alias = records
    record(records, "A", "x", "y")
    record(records, "A", "x", "z")
    assert alias is records and alias == [{"node": "A", "requested": "x", "active": "z", "note": "", "short": ""}]


def test_a_copied_list_is_independent():
    original = []
    record(original, "A", "x", "y")
    copied = [dict(r) for r in original]
    record(copied, "A", "x", "z")
    record(copied, "B", "x", "y")
    assert original == [{"node": "A", "requested": "x", "active": "y", "note": "", "short": ""}]


def test_a_filed_entry_round_trips_through_keyword_arguments():
    records, other = [], []
    record(records, "A", "x", "y", "why")
    record(other, **records[0])
    assert other == records


def test_a_node_that_did_less_than_asked_files_one_line_saying_so():
    records = []
    entry = record(records, "SDOptCUDAGraph", "max_graphs=4", "eager", "CUDA graphs need a CUDA device", "runs eager: no CUDA")
    assert entry.short == "runs eager: no CUDA" and records[0]["short"] == "runs eager: no CUDA"
    assert record(records, "SDOptCUDAGraph", "max_graphs=4", "CUDA graph").short == "", "a later record that did all says nothing"
