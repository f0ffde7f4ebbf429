"""The decoding layer: members, their per-request state, every forward pass, the shared loop.

From the bottom: :mod:`.cache` and :mod:`.slab` (KV storage), :mod:`.masks` (attention masks
and layer layouts), :mod:`.forward` (every model call, alone or batched), :mod:`.scheduler`
(which requests share a pass), :mod:`.members` (a member and its decoding state),
:mod:`.rows` and :mod:`.verify_inline` (reading and scoring), :mod:`.lookup` and
:mod:`.drafting` (drafting loops), :mod:`.generation` (configs, the method base class and
the shared generation loop), :mod:`.sampling` (choosing a token, on the device), :mod:`.pipeline`
and :mod:`.view` (a member within one request),
:mod:`.stats`.
"""
