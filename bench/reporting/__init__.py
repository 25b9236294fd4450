"""What every section of bench/report.py shares: the results and their lookups, number
formatting, the machine's description, and the document's assembly."""
