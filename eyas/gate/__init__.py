"""The approval gate's library side: the summary a reviewer decides on, the records of decisions."""

# The event a deployment's run sends for itself just before it suspends at the gate (tasks.gate), which the
# crash automation (eyas_cli.automation) expects after a heartbeat. Prefect's own Suspended event follows the
# run's previous state event, and the server's triggers hold it until they have processed that one: on a busy
# server for minutes, past the automation's window. This one follows nothing and is counted on arrival.
GATE_SUSPENDING_EVENT = "eyas.gate.suspending"
