"""Text and vocabulary work, below everything that decodes.

* :mod:`.alignment`: tokenizing and re-tokenizing shared text per member, token boundaries.
* :mod:`.chat`: prompts, message normalisation, chat templates and reply leads.
* :mod:`.distributions`: a member's vocabulary as text, UniTE / GaC fusion, sharpening.
"""
