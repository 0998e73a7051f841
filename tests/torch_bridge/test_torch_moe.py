"""A transformers mixture of experts on ``backend: torch``: the built-in loss adds its load-balancing loss as
transformers' own forward does (``output_router_logits``), and refuses packed batches in one line."""

import numpy as np
import pytest
import torch

from functrain.errors import ConfigError
from tests.models.moe.test_balance import hf_batch
from tests.torch_bridge.hf.test_hf_moe import build_moe_model
from torch_bridge.user_model import default_causal_lm_loss


def test_the_balancing_loss_is_added_as_transformers_adds_it():
    model = build_moe_model("qwen2_moe")
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.3
    model.router_aux_loss_coef = 0.3
    batch = hf_batch()
    batch["weight"][:] = 1.0
    batch = {"tokens": batch["input_ids"] % model.config.vocab_size, **batch}
    batch = {name: torch.tensor(value) for name, value in batch.items() if name != "input_ids"}
    targets = torch.where(batch["attention_mask"][:, 1:] == 1, batch["tokens"][:, 1:], -100)
    with torch.no_grad():
        reference = model(input_ids=batch["tokens"][:, :-1], attention_mask=batch["attention_mask"][:, :-1],
                          labels=targets, shift_labels=targets)
        loss_sum, weight, aux = default_causal_lm_loss(model, batch, None)
    assert float(reference.aux_loss) > 0
    np.testing.assert_allclose(float(aux["moe/aux_loss"] / weight), float(reference.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(loss_sum / weight), float(reference.loss), rtol=1e-5)


def test_packed_batches_are_refused_in_one_line():
    model = build_moe_model("mixtral")
    model.config.output_router_logits = True
    tokens = torch.randint(0, 90, (2, 9))
    batch = {"tokens": tokens, "weight": torch.ones(2), "segment_ids": torch.ones_like(tokens),
             "positions": torch.arange(9).expand(2, 9)}
    with pytest.raises(ConfigError, match="data.packing=false") as caught:
        default_causal_lm_loss(model, batch, None)
    assert "\n" not in str(caught.value)
