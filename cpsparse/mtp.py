"""The MTP (multi-token prediction) draft driver: step-0 top-k, reused by steps 1+.

A draft round of ``k`` steps over an MTP layer (``docs/contract.md``, "MTP step-0
top-k reuse"):

1. step 0 runs the layer on every step-0 token; its indexer scores them and
   writes top-k rows ``[0, T0)`` of the shared buffer;
2. ``layer.begin_topk_reuse(step0_batch)``: the layer checks that its indexer
   scored step 0, compacts the rows to one per request,
   ``buf[:R] = buf[last_token_row_of_each_request]``, and turns the reuse on;
3. steps ``1 .. k-1`` (one token per request) run attention on rows
   ``[0, R)`` without calling the indexer;
4. ``layer.end_topk_reuse()`` when the round ends, also when a step raises.

The approximation: a draft token at step i attends to the keys that step 0
selected for its request's last token; keys written by steps 1 .. i-1 are
not candidates. vLLM measured this 2x faster on the draft steps that reuse.
"""

from cpsparse.metadata import ForwardContext

__all__ = ["MTPDrafter"]


class MTPDrafter:
    """Run draft rounds of ``num_steps`` steps over one MTP layer.

    Parameters
    ----------
    layer : cpsparse.mla.DeepseekV32MLA
        Built with ``is_mtp_layer=True`` (and its own indexer).
    num_steps : int
        Draft steps per round (k >= 1); steps 1 .. k-1 reuse step 0's top-k.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.metadata import ForwardContext, build_batch
    >>> from cpsparse.mla import DeepseekV32MLA, MLAConfig
    >>> from cpsparse.mtp import MTPDrafter
    >>> cfg = MLAConfig.small()
    >>> layer = DeepseekV32MLA(cfg, "mtp.0", is_mtp_layer=True)
    >>> layer.allocate_kv_cache(num_blocks=16, max_num_tokens=256)
    >>> table = np.arange(16, dtype=np.int32).reshape(2, 8)
    >>> rng = np.random.default_rng(0)
    >>> step0 = build_batch([70, 90], [0, 0], table, block_size=cfg.block_size,
    ...                     index_topk=cfg.index_topk)
    >>> def next_step(step, previous_output):
    ...     meta = build_batch([1, 1], [70 + step - 1, 90 + step - 1], table,
    ...                        block_size=cfg.block_size, index_topk=cfg.index_topk)
    ...     x = rng.standard_normal((2, cfg.hidden_size)).astype(np.float32)
    ...     return x, ForwardContext.for_layers(meta, ["mtp.0"])
    >>> x0 = rng.standard_normal((160, cfg.hidden_size)).astype(np.float32)
    >>> outs = MTPDrafter(layer, num_steps=3).run_round(
    ...     x0, ForwardContext.for_layers(step0, ["mtp.0"]), next_step)
    >>> [o.shape for o in outs], layer.indexer.stats.calls, layer.skip_topk
    ([(160, 256), (2, 256), (2, 256)], 1, False)
    """

    def __init__(self, layer, num_steps):
        if not getattr(layer, "is_mtp_layer", False):
            raise ValueError("Invalid layer: expected an MTP layer (is_mtp_layer=True), "
                             f"got {layer!r}")
        if layer.indexer is None:
            raise ValueError("Invalid layer: the MTP layer must own an indexer (it scores "
                             "step 0); got an index-sharing layer")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"Invalid num_steps: expected an int >= 1, got {num_steps!r}")
        self.layer = layer
        self.num_steps = num_steps


    def run_round(self, hidden_states, forward_context, next_step):
        """One draft round.

        Parameters
        ----------
        hidden_states : [T0, hidden]
            Step-0 inputs (all step-0 tokens of every request).
        forward_context : ForwardContext
            Step 0's batch.
        next_step : callable ``(step, previous_output) -> (hidden_states, ForwardContext)``
            Builds step ``step``'s one-token-per-request input (same requests,
            same order).

        Returns
        -------
        list of outputs, one per step
        """
        layer = self.layer
        batch0 = forward_context.batch
        outputs = []
        try:
            outputs.append(layer.forward(hidden_states, forward_context=forward_context))
            if self.num_steps == 1:
                return outputs
            layer.begin_topk_reuse(batch0)      # the layer owns the protocol
            for step in range(1, self.num_steps):
                x, ctx = next_step(step, outputs[-1])
                if not isinstance(ctx, ForwardContext):
                    raise TypeError(f"Invalid next_step result: expected (hidden_states, "
                                    f"ForwardContext), got {type(ctx).__qualname__}")
                batch = ctx.batch
                if batch.num_reqs != batch0.num_reqs or batch.num_tokens != batch0.num_reqs:
                    raise ValueError(f"Invalid draft step {step}: expected one token for each "
                                     f"of the {batch0.num_reqs} requests, got "
                                     f"{batch.num_tokens} tokens in {batch.num_reqs} requests")
                outputs.append(layer.forward(x, forward_context=ctx))
            return outputs
        finally:
            layer.end_topk_reuse()
