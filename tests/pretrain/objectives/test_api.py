"""The public entry point ``batch_loss``: keywords where a mistake would be silent, clear
errors for missing inputs, the named output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.objectives import BatchRows, ObjectiveOutput, batch_loss, local_batch


def test_temperature_cannot_be_passed_as_labels(batch):
    with pytest.raises(TypeError, match="labels must be a tensor, got float 0.5"):
        batch_loss("infonce", batch.z, batch.ids, 0.5, temperature=0.1)
    with pytest.raises(TypeError, match="temperature"):
        batch_loss("infonce", batch.z, batch.ids)


def test_xclr_takes_captions_or_a_class_graph_not_both(batch):
    graph = torch.eye(6, dtype=torch.float64)
    with pytest.raises(ValueError, match="not both"):
        batch_loss("xclr", batch.z, batch.ids, batch.labels, captions=batch.captions,
                   class_graph=graph, temperature=0.1)


def test_output_is_named_and_holder_flatnce_reports_its_temperature(batch):
    out = batch_loss("holder_flatnce", batch.z, batch.ids, temperature=0.2, gamma=4.0)
    assert isinstance(out, ObjectiveOutput)
    assert float(out.metrics["temperature"]) == pytest.approx(0.2)
    assert float(out.metrics["effective_temperature"]) == pytest.approx(0.05)
    flat = batch_loss("flatnce", batch.z, batch.ids, temperature=0.05)
    assert float(out.metrics["infonce"]) == pytest.approx(float(flat.metrics["infonce"]))


def test_a_range_of_anchors_is_a_view_of_the_candidates(batch):
    """``anchor_start`` makes ``anchors`` the candidate rows themselves (no [n, D] copy),
    equal to the rows ``anchor_index`` names."""
    whole = local_batch(BatchRows(batch.z, batch.ids))
    ranged = dataclasses.replace(whole, anchor_index=torch.arange(3, 9), anchor_start=3)
    gathered = dataclasses.replace(ranged, anchor_start=None)
    assert ranged.anchors.untyped_storage().data_ptr() == \
        ranged.candidates.untyped_storage().data_ptr()
    assert gathered.anchors.untyped_storage().data_ptr() != \
        gathered.candidates.untyped_storage().data_ptr()
    torch.testing.assert_close(ranged.anchors, gathered.anchors, rtol=0, atol=0)
    assert whole.anchors.shape == whole.candidates.shape and whole.anchor_start == 0
