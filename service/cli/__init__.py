"""The CLI process: `trainjobs` commands over the SDK (trainjobs.client), following, tables, `up` and `demo`."""
