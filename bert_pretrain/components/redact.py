"""Keep secrets out of what a run writes.

Credentials live in environment variables (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
bert-train never reads them into its config, but a config may interpolate one
(`${oc.env:HF_TOKEN}`), and the resolved config is saved in every checkpoint and sent to wandb.
`redact` replaces the value of every secret-looking variable with `<redacted:NAME>`.
"""
import os
import re

# *_TOKEN, *_KEY, *SECRET*, *PASSWORD*, *CREDENTIAL*: the usual spellings of credentials.
SECRET_NAME = re.compile(r"(TOKEN|_KEY|^KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
MIN_LENGTH = 6  # shorter values ("1", "true") are settings, and replacing them would mangle text


def secret_values(environ=None) -> dict:
    """{value: NAME} of the secret-looking environment variables, longest value first."""
    env = os.environ if environ is None else environ
    found = {v: k for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_LENGTH}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def redact(obj, secrets=None):
    """`obj` (str, or lists/tuples/dicts of them) with every secret value replaced."""
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return obj
    if isinstance(obj, str):
        for value, name in secrets.items():
            obj = obj.replace(value, f"<redacted:{name}>")
        return obj
    if isinstance(obj, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets) for v in obj)
    return obj
