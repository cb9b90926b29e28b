"""`python -m ecrec.coordinator ARGS`: the coordinator process (as `ecrec coordinator ARGS`)."""

from ecrec.coordinator import main

main()
