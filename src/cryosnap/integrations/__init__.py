"""Integrations with training frameworks: exact resume of what lives outside the model.

``cryosnap.integrations.torch`` holds :class:`~cryosnap.integrations.torch.RNGState` (every
random number generator a training loop draws from) and the resumable data order
(:class:`~cryosnap.integrations.torch.ResumableSampler`,
:class:`~cryosnap.integrations.torch.ResumableLoader`). Each submodule imports its framework
itself; importing ``cryosnap`` imports none of them.
"""
