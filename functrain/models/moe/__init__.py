"""Mixtures of experts: the layer, its routing and dispatch, the balancing terms, and the decoder the MoE
families share.

- :mod:`.routing`: ``router(logits[T, E]) -> Routing(weights[T, k], experts[T, k], probs[T, E])``, pure
  functions a family binds its settings to (Mixtral's and Qwen's :func:`.routing.softmax_topk`);
- :mod:`.dispatch`: the grouped (sorted tokens, ``jax.lax.ragged_dot``) and dense expert computations, and the
  optional capacity;
- :mod:`.layer`: :class:`.layer.MoeBlock`, the router and the stacked experts (logical axes ``expert``,
  ``embed``, ``mlp``), returning its output and :class:`.layer.RouterStats` (sums over real tokens);
- :mod:`.balance`: :class:`.balance.MoeTerms` (every layer's statistics) and the auxiliary and z
  losses and ``moe/`` metrics every task's loss adds from it (``model.load_balance_scope``);
- :mod:`.decoder`: the Llama-shaped decoder with a family's feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE).
"""
