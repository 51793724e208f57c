#!/usr/bin/env python3
"""How long_prefill.txt was made: a field log of a coastal station network, drawn from
sentence templates with a fixed seed, then a question about it.

The committed text file is the fixture (its sha256 is pinned in manifest.json); this script
only documents where it came from. Running it again writes the same bytes:

    python bench/workloads/make_long_prefill.py > bench/workloads/long_prefill.txt

Sized at about 70,000 characters: some 16,000 tokens for the BPE tokenizers of Qwen3 and
Llama 3 on English prose (4.3-4.6 characters per token). Mixtral's 32k-token vocabulary
yields more; a run reports the server's own count and says whether it is in class.
"""

import random

STATIONS = ["North Pier", "Gull Rock", "Saltmarsh", "Cape Ardent", "Widow's Point", "Harbour Wall",
            "Lantern Hill", "Seal Cove", "Drift Bay", "Old Quarry", "Beacon Head", "Mill Creek"]
CREWS = ["Amara", "Bjorn", "Chiara", "Declan", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonah"]
WEATHER = ["a steady westerly wind and clear skies", "thick fog that lifted only after noon",
           "heavy rain driven by a southerly gale", "light snow and a falling barometer",
           "a flat calm with low cloud", "gusts strong enough to rattle the mast",
           "freezing spray over the sea wall", "warm sunshine and a light breeze from the land"]
FAULTS = ["the battery bank dropped below its safe voltage overnight",
          "the anemometer stopped turning and reported zero wind for six hours",
          "the radio link lost contact twice before dawn",
          "water had seeped into the junction box under the mast",
          "the solar panel was covered in salt and produced almost nothing",
          "the pressure sensor drifted away from the reference reading",
          "a cable clamp had worked loose and the mast swayed in the gusts",
          "the logger clock had fallen behind and the timestamps were wrong",
          "the main power feed failed when a pole came down on the coast road",
          "gulls had nested on the rain gauge and blocked the funnel"]
ACTIONS = ["replaced the fuse and tested the circuit under load",
           "cleaned the panel with fresh water and checked the charge controller",
           "resealed the junction box and added a drying pack",
           "swapped the anemometer for the spare from the depot",
           "recalibrated the sensor against the portable reference",
           "tightened every clamp on the mast and added a safety wire",
           "reset the logger clock from the satellite receiver",
           "fitted a temporary generator until the line crew arrived",
           "moved the antenna higher and restored the link",
           "cleared the funnel and fitted a wire guard over the gauge"]
OUTCOMES = ["The station has reported normally since then.",
            "Readings were back within tolerance by the evening.",
            "A follow-up visit is planned for the next calm day.",
            "The crew noted that the same fault had happened the previous winter.",
            "The repair held through the storm that followed.",
            "The depot has been asked to order two more spares.",
            "The crew recommended a permanent fix before the storm months.",
            "Nothing else was found on a full inspection of the site."]
ROUTES = ["The coast road was open and the drive took under an hour.",
          "The coast road was closed, so the crew walked in along the cliff path.",
          "The crew went out by boat because a landslip blocked the track.",
          "Snow on the hill road slowed the crew, and they arrived after dark.",
          "The crew waited for the tide before crossing the causeway."]


def entry(rng: random.Random, n: int) -> str:
    station = rng.choice(STATIONS)
    crew = rng.sample(CREWS, 2)
    parts = [f"Entry {n}: {station}.",
             f"The day began with {rng.choice(WEATHER)}.",
             f"On the morning check, {crew[0]} found that {rng.choice(FAULTS)}.",
             rng.choice(ROUTES),
             f"{crew[0]} and {crew[1]} {rng.choice(ACTIONS)}."]
    if rng.random() < 0.5:
        parts.append(f"While on site they also found that {rng.choice(FAULTS)}, and {crew[1]} "
                     f"{rng.choice(ACTIONS)}.")
    parts.append(rng.choice(OUTCOMES))
    return " ".join(parts)


def main() -> None:
    rng = random.Random(20240301)
    paragraphs = ["Field log of the coastal station network, winter season. Each entry records "
                  "one visit: the station, the weather, what the crew found, how they reached the "
                  "site, what they did and how it turned out."]
    n = 1
    while sum(len(p) + 2 for p in paragraphs) < 69_600:
        paragraphs.append(entry(rng, n))
        n += 1
    paragraphs.append("Question: using only the log above, name the three stations that lost "
                      "power most often, and for each one say what the crews did about it and "
                      "what they recommended.")
    print("\n\n".join(paragraphs))


if __name__ == "__main__":
    main()
