"""``grpo.sampler: paged``: the settings of the paged sampler (:mod:`functrain.text.paged_decode`) for a run's
prompts, checked."""

from __future__ import annotations

from functrain.errors import ConfigError
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.prompts import Prompts
from functrain.text.paged_decode import Paging, default_page_size


def paging_of(section: GRPOConfig, prompts: Prompts, episodes: bool) -> Paging | None:
    """The paged sampler's settings (None: ``grpo.sampler: dense``): ``grpo.page_size`` (default: the largest of at
    most 16 positions that divides the cache) must divide the sampler's cache, the longest prompt (with an
    environment, and an episode's ``max_completion_length - 1`` tokens) and a completion (a turn) but its last
    token; ``grpo.decode_slots`` rows at once; a row ends at the prompts' EOS."""
    if section.sampler == "dense":
        return None
    width = prompts.longest + (section.max_completion_length - 1 if episodes else 0)
    cache_length = width + (section.turn_length if episodes else section.max_completion_length) - 1
    page_size = section.page_size or default_page_size(cache_length)
    if cache_length % page_size:
        divisors = [size for size in range(1, cache_length + 1) if cache_length % size == 0]
        raise ConfigError(
            f"grpo.page_size={page_size} does not divide the paged sampler's cache of {cache_length} positions (the "
            f"longest prompt's {width} and {cache_length - width + 1} new tokens but the last); set grpo.page_size "
            f"to one of {divisors}"
        )
    return Paging(page_size, section.decode_slots, prompts.eos_ids)
