"""Writes bench/prompts/draft_acceptance.jsonl: our own prompts (no downloads) in four task families.

    python bench/drafts/make_draft_prompts.py

Each line: {"family": ..., "id": ..., "prompt": ...}. The copy-heavy families (rewrite, edit,
extract) give the model a text to work on; chat gives it none. Texts are combined with several
instructions, so each family has a few dozen prompts.
"""

from __future__ import annotations

import json
import pathlib

CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of Python.",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Tell me a fun fact about octopuses.",
    "How can I sleep better?",
    "What is gravity?",
    "Describe a sunset in two sentences.",
    "What are the primary colors?",
    "How do plants drink water?",
    "Why do we have seasons?",
    "What is a good way to start running?",
    "Explain what a database is to a child.",
    "What is the largest planet in the solar system?",
    "Write a haiku about autumn.",
    "How do bees make honey?",
    "What should I pack for a weekend hike?",
]

PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new bike lanes on Main Street. Several shop owners said the "
    "lanes would reduce parking for their customers, while cyclists argued that the street is dangerous without "
    "them. The council agreed to run a six month trial and to count both cyclists and shoppers before deciding.",
    "Our team moved the billing service to a new database last week. The migration took four hours instead of the "
    "planned two, because one table had far more rows than expected. No customer data was lost, but invoices were "
    "sent one day late. Next time we will test the migration on a full copy of the data first.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance tells the other bees "
    "the direction of the food relative to the sun, and the length of the dance tells them how far away it is. "
    "Scientists decoded this language in the twentieth century.",
    "The library will close at six in the evening during the summer months. Members can still return books through "
    "the drop box by the front door at any time. The reading room on the second floor will be closed for repairs "
    "from the first of July until the end of August.",
    "Maria planted tomatoes, beans and basil in her small garden this spring. The tomatoes grew slowly at first "
    "because of the cold weather, but by July the plants were taller than her. She gave most of the harvest to her "
    "neighbours and kept the basil for pesto.",
    "The new phone has a larger screen, a faster processor and a battery that lasts two days. However, it is heavier "
    "than the previous model and it no longer has a headphone jack. The price is the same as last year's phone.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so water "
    "boils at a lower temperature. This is why cooking pasta in the mountains takes longer than cooking it at the "
    "coast.",
    "The train from Lyon to Paris was delayed by forty minutes this morning because of a signal failure near Dijon. "
    "Passengers were offered free coffee and a voucher for a future trip. The railway company apologised and said "
    "the signal has now been repaired.",
]
REWRITE = [
    "Rewrite the following paragraph in simpler words:\n\n{}",
    "Summarise the following paragraph in two sentences:\n\n{}",
    "Fix any grammar mistakes and return the paragraph:\n\n{}",
]

SNIPPETS = [
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "def greet(name):\n    print('Hello, ' + name + '!')\n    return None\n",
    "def find_max(items):\n    best = items[0]\n    for item in items:\n        if item > best:\n"
    "            best = item\n"
    "    return best\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
    "    def increment(self):\n        self.count += 1\n",
    "def read_lines(path):\n    f = open(path)\n    lines = f.readlines()\n    f.close()\n    return lines\n",
    "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        return False\n",
    "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n\n\ndef fahrenheit_to_celsius(f):\n"
    "    return (f - 32) * 5 / 9\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        if word in counts:\n"
    "            counts[word] += 1\n        else:\n            counts[word] = 1\n    return counts\n",
]
EDIT = [
    "Add type hints to this Python code and return the whole code:\n\n```python\n{}```",
    "Rename the function in this Python code to use a clearer name and return the whole code:\n\n```python\n{}```",
    "Add a docstring to this Python code and return the whole code:\n\n```python\n{}```",
]

RECORDS = [
    "Order 4471 was placed by John Smith on 3 March 2024. He bought two blue chairs for 120 euros each and asked "
    "for delivery to 14 Rose Street, Bristol.",
    "Dr. Anna Lee will see the patient Tom Brown on Friday 12 April at 9:30 in room 5 of the Northside Clinic. "
    "The visit is a follow-up for his knee injury.",
    "The apartment at 22 Baker Road has three bedrooms, one bathroom and a balcony. The rent is 1,450 dollars per "
    "month and it is available from 1 June. Contact Sarah on 555-0199.",
    "Flight BA 284 from London to San Francisco departs at 11:05 on 8 May from terminal 5, gate B32. Passenger: "
    "Li Wei, seat 34A, economy class.",
    "Invoice 2024-118 from Green Leaf Supplies to Oak Cafe: 40 kg of coffee beans at 9 euros per kg, due on "
    "30 September. Pay by bank transfer to account DE44 5001 0517 5407 3249 31.",
    "Job posting: Backend Engineer at Nordwind GmbH in Hamburg. Salary 70,000 to 85,000 euros. Requires five years "
    "of Python experience. Apply by 15 October to jobs@nordwind.example.",
    "Event: Spring Music Festival, Saturday 18 May, 2 pm to 10 pm, Riverside Park. Tickets cost 25 pounds, children "
    "under twelve enter free. Organiser: City Arts Trust.",
    "Recipe: Lemon cake. Serves 8. Preparation time 20 minutes, baking time 45 minutes at 180 degrees. Ingredients: "
    "flour, sugar, butter, three eggs and two lemons.",
]
EXTRACT = [
    "Extract the names, dates and amounts from this text as JSON:\n\n{}",
    "List every number in this text with what it refers to:\n\n{}",
    "Extract the key fields of this text as a bulleted list of 'field: value' lines:\n\n{}",
]


def prompts() -> list[dict]:
    rows = [{"family": "chat", "id": f"chat-{i}", "prompt": p} for i, p in enumerate(CHAT)]
    for family, texts, templates in (
        ("rewrite", PARAGRAPHS, REWRITE),
        ("edit_code", SNIPPETS, EDIT),
        ("extract", RECORDS, EXTRACT),
    ):
        # Interleave instructions so that the first few prompts of a family cover all of them.
        for t in range(len(texts)):
            for j, template in enumerate(templates):
                rows.append(
                    {
                        "family": family,
                        "id": f"{family}-{t}-{j}",
                        "prompt": template.format(texts[(t + j) % len(texts)]),
                    }
                )
    return rows


def main() -> None:
    out = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "draft_acceptance.jsonl"
    with open(out, "w") as f:
        for row in prompts():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
