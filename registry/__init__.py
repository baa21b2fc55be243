"""The model registry, between training and its users (evaluation, export, serving):
the files of a registered version and their digests (``package``), registration,
resolution and verification of versions (``versions``), the evaluation record a version
carries (``evaluation_record``) and the promotion of an alias to a better version
(``promote``).

May import ``core``, ``data_pipeline`` and ``pretrain``; never ``serving``, ``evaluation``
or ``app``: the serving layer hands registration its model-from-code file
(``versions.ServedForm``).
"""
