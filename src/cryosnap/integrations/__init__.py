"""Integrations with training frameworks: exact resume of what lives outside the model.

``cryosnap.integrations.torch`` holds :class:`~cryosnap.integrations.torch.RNGState` (every
random number generator a training loop draws from) and the resumable data order
(:class:`~cryosnap.integrations.torch.ResumableSampler`,
:class:`~cryosnap.integrations.torch.ResumableLoader`). ``cryosnap.integrations.lightning`` and
``cryosnap.integrations.transformers`` hold one callback each, built on the shared base
``cryosnap.integrations._base.RunSaver`` (save policy, run identity, preemption);
docs/INTEGRATIONS.md shows how to use them and which resume paths are exact. Each submodule
imports its framework itself; importing ``cryosnap`` imports none of them.
"""
