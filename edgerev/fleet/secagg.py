"""SecAgg+ for the fleet (Flower's ``secaggplus_mod`` on the device, its workflow on the server)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod

SECAGG_CONFIGS = "secaggplus_configs"  # flwr.common.secure_aggregation.secaggplus_constants.RECORD_KEY_CONFIGS


def when_secagg(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` on a message that is a stage of the SecAgg+ protocol; others pass."""
    if msg.has_content() and SECAGG_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)
