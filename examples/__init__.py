"""Reference ranking models, written the way model authors write them today (the user side
gathered to the candidate batch with ``[idx]`` or ``index_select``, then concat, ``nn.Linear``
and SDPA), each beside the same model written by hand with the IKBO ops (same weights).

Every model's ``forward`` takes the user inputs, the candidate inputs and ``idx`` [B] (the
candidate -> user index); ``make_inputs(cfg, B, U)`` draws a request of the model's shapes.

- :mod:`examples.wukong`: a Wukong-style block: linear compression over stacked user and
  candidate embeddings, then an MLP.
- :mod:`examples.din`: DIN/BST-style target attention: the candidate item as one query
  over its user's behaviour sequence (jagged lengths, padded, key-padding mask), then an
  MLP on concat([user summary, attention output, candidate features]).
- :mod:`examples.multi_seed`: multi-seed target attention (S_q seeds per candidate).
- :mod:`examples.combined`: the three in one ranking request.
"""
