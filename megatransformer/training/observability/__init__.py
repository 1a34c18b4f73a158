"""What a run reports and watches: metrics, trackers, host-sync probes, the hang watchdog."""
