"""The ECRecJob operator (kopf): pods from the job's spec, replacements and recoveries, status."""
