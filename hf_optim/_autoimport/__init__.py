"""The start-up hook of ``hf-optim run`` (see ``sitecustomize.py``): a directory put on ``PYTHONPATH``, not an API."""
