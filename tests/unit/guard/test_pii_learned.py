"""The learned personal-data decision's experiment (scripts/exp_exp.py): its candidates,
features, labels, threshold and training."""
from __future__ import annotations

import zlib

import numpy as np

from scripts import exp_pii_learned as exp
from sidecar.guard import pii


def test_phone_candidates_include_what_the_context_rules_drop():
    # "order" before a valid national number: the rules drop it (an order's number); the model
    # is asked about it, with the words around it as n-grams.
    text = "order 0412 738 195 shipped"
    assert pii.find(text, ("phone",)) == []
    [candidate] = exp.phone_candidates(text)
    assert text[candidate.start:candidate.end] == "0412 738 195"
    assert "b3:ord" in candidate.features and "valid_grouped" in candidate.features


def test_a_candidate_no_validator_accepts_is_none():
    # The hard checks stay: an invalid number, an unparsable address, a dotted version of five parts.
    assert exp.phone_candidates("ref 0000 000 000") == []
    assert exp.ip_candidates("build 1.2.3.4.5 and 999.1.1.1") == []


def test_ip_candidates_carry_the_validators_outputs():
    [candidate] = exp.ip_candidates("firmware 4.2.1.0")
    assert {"v4", "cidr=False", "small=4"} <= set(candidate.features)
    [network] = exp.ip_candidates("allow 10.0.0.0/8")
    assert "cidr=True" in network.features


def test_secret_candidates_include_tokens_the_entropy_rule_drops():
    text = "the value is 9e107d9d372bb6826bd81d3542a419d6 in the config"
    assert pii.find(text, ("secret",)) == []
    [candidate] = exp.secret_candidates(text)
    assert "path=run" in candidate.features and "hex=True" in candidate.features


def test_hashed_features_are_the_same_in_every_process():
    # crc32, not hash(): a model trained in one process scores in another.
    assert exp.hashed(["bias", "bias"]).tolist() == [zlib.crc32(b"bias") % exp.BUCKETS]


def test_candidates_overlapping_a_planted_item_are_labelled_one():
    row = {"text": "call 030 901820 or order 0412 738 195", "items": [{"detector": "phone", "value": "030 901820"}]}
    data = exp.Featurised([row], "phone")
    spans = [row["text"][a:b] for a, b in data.spans]
    assert dict(zip(spans, data.labels.tolist())) == {"030 901820": 1.0, "0412 738 195": 0.0}


def test_threshold_is_the_lowest_score_that_keeps_precision():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    labels = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    # 2 of 2 kept at 0.8; 2 of 3 at 0.7: below the target.
    assert exp.threshold_for(scores, labels) == 0.8
    assert exp.threshold_for(np.array([0.4]), np.array([0.0])) == 1.0


def test_training_separates_a_feature_that_decides():
    rows = [np.array(sorted(exp.hashed(["bias", f"x={i % 2}"]))) for i in range(40)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    labels = np.array([i % 2 for i in range(40)], float)
    w = exp.train(np.concatenate(rows), indptr, labels)
    margins = exp.margins(w, np.concatenate(rows), indptr)
    assert (margins[labels == 1] > 0).all() and (margins[labels == 0] < 0).all()


def test_the_models_spans_replace_the_rules_and_are_counted_as_eval_guard_counts():
    row = {"text": "call 030 901820 or order 0412 738 195", "items": [{"detector": "phone", "value": "030 901820"}]}
    featurised = {"phone": exp.Featurised([row], "phone")}
    weights = np.zeros(exp.BUCKETS)                      # every candidate scores 0.5
    keep_all = exp.compare({"phone": exp.Model(weights, 0.5)}, featurised, [row])
    keep_none = exp.compare({"phone": exp.Model(weights, 1.0)}, featurised, [row])
    assert keep_all["rules"]["phone"] == {"tp": 1, "fp": 0, "fn": 0}
    assert keep_all["learned"]["phone"] == {"tp": 1, "fp": 1, "fn": 0}
    assert keep_none["learned"]["phone"] == {"tp": 0, "fp": 0, "fn": 1}
