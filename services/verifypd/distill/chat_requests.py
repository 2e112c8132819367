"""Chat requests for `verifypd distill`'s own samples: what people type into a chat assistant, from our
own templates (torch-free, deterministic for a seed).

Two sources feed distill.data.own_prompts' question half:
  * template_requests: a template of one request kind (direct facts, explain, lists, how-to, poems
    and stories, advice, names, comparisons, definitions, why/how-questions, summaries, descriptions,
    short writing, small code, plans, recommendations) with its slots filled from the pools below;
  * writer_asks: instructions that ask the target itself to write one request of a kind about a
    topic (its own wording, sampled).
The kinds are dealt round robin over a shuffled order, so each kind gets count // len(KINDS) or one
more. All wording is ours; nothing here comes from an evaluation set (the held-out prompts of
bench/prompts/draft_acceptance.jsonl are checked against every expansion by a test, and their
subjects are left out of the pools).
"""

from __future__ import annotations

import itertools
import random
import string

# The word lists read better packed than one item a line.
# fmt: off
NUMBERS = ["two", "three", "four", "five", "six", "seven", "3", "5", "10"]
CONCEPTS = [
    "inflation", "a neural network", "the water cycle", "compound interest", "a credit score", "plate tectonics",
    "an API", "a hash table", "vaccination", "the stock market", "machine learning", "a solar panel", "evolution",
    "democracy", "the Internet", "DNA", "a recession", "supply and demand", "a blockchain", "the placebo effect",
    "climate change", "quantum computing", "an operating system", "cloud computing", "the greenhouse effect",
    "tides", "earthquakes", "jet lag", "encryption", "version control", "a spreadsheet", "meditation",
    "the Pythagorean theorem", "prime numbers", "probability", "interest rates", "an index fund", "the Renaissance",
    "the printing press", "the Silk Road", "jazz", "impressionism", "a sonnet", "vitamins", "allergies",
    "antibiotics", "short-term memory", "habit formation", "procrastination", "negotiation", "a cover letter",
    "recursion", "object-oriented programming", "a firewall", "electric motors", "the immune system",
    "black holes", "the Big Bang", "carbon dating", "a food chain", "composting", "a budget deficit",
    "exchange rates", "insurance", "a pension", "minimalism", "stoicism", "a time zone", "daylight saving time",
    "a thermostat", "nuclear energy", "wind power", "3D printing", "a search engine", "two-factor authentication",
    "a web browser", "an algorithm", "a loop in programming", "unit testing", "the scientific method", "a hypothesis",
    "fermentation", "gluten", "metabolism", "cholesterol", "the food pyramid", "a marathon training plan",
]
TASKS = [
    "make a good cup of tea", "change a flat bicycle tire", "write a clear email subject line", "plant tomatoes",
    "save money on groceries", "learn to touch type", "clean a laptop keyboard", "make pancakes from scratch",
    "set up a monthly budget", "prepare for a job interview", "fold a paper airplane", "tie a tie", "cook rice",
    "remove a coffee stain from a shirt", "back up my phone", "make friends in a new city", "study for a math exam",
    "write a thank-you note", "spend less time on my phone", "keep houseplants alive", "teach a puppy to sit",
    "start learning the guitar", "start a journal", "bake a loaf of bread", "organise my wardrobe",
    "plan a birthday party", "read more books", "stay focused while working from home", "speed up an old laptop",
    "build a simple website", "sort a list in Python", "read a CSV file in Python", "reverse a string in Python",
    "use branches in git", "make a smoothie", "write a short speech", "memorise a poem", "improve my posture",
    "calm down before an exam", "make a paper crane", "choose a good password", "wash a wool sweater",
    "write a haiku", "take better photos with my phone", "start meditating", "negotiate a higher salary",
]
PLURALS = [
    "benefits of walking every day", "healthy breakfast ideas", "countries in South America", "famous painters",
    "programming languages for beginners", "board games for a family evening", "hobbies you can do indoors",
    "ways to save energy at home", "fruits rich in vitamin C", "things to do on a long train ride",
    "reasons to learn a second language", "common mistakes new drivers make", "animals that live in the desert",
    "inventions that changed the world", "ways to reduce stress", "easy dinners for busy evenings",
    "questions to ask at the end of a job interview", "words that rhyme with light", "sources of protein",
    "tips for writing a good essay", "features of a good password", "planets in our solar system",
    "ingredients for a simple salad", "signs of dehydration", "skills every programmer needs",
    "ways to be kinder to the planet", "famous scientists", "musical instruments", "uses of baking soda",
    "birds you can see in a city park", "ideas for a rainy weekend", "ways to stay warm in winter",
]
POEM_FORMS = ["a short poem", "a limerick", "a four-line poem", "a very short story", "a rhyming couplet",
              "a short bedtime story", "a haiku", "a two-sentence story", "a short song verse"]
POEM_SUBJECTS = [
    "the city at night", "a lost umbrella", "a cat on a windowsill", "the first snow of the year", "friendship",
    "a robot learning to paint", "morning coffee", "a lighthouse", "the mountains", "a long train journey",
    "an old library", "summer rain", "the moon", "a garden in spring", "a dragon afraid of the dark",
    "a forgotten key", "the ocean at dawn", "a busy kitchen", "a paper boat", "a grandmother's recipe",
]
ADVICE_FOR = [
    "studying late at night", "a first day at a new job", "working from home", "saving for a holiday",
    "speaking in public", "writing readable code", "drinking more water", "traveling on a tight budget",
    "moving to a new country", "running a meeting", "learning to swim as an adult", "keeping a tidy desk",
    "getting up early", "staying motivated at the gym", "talking to a difficult coworker", "starting a podcast",
]
NAMED_THINGS = [
    "a coffee shop", "a pet goldfish", "a fantasy kingdom", "a podcast about history", "a hiking club",
    "a recipe app", "a friendly robot", "a rock band", "a food truck", "a book club", "a board game",
    "a shop that sells houseplants", "a grey kitten", "a sailboat", "a cleaning company", "a fitness blog",
]
PAIRS = [
    "weather and climate", "a list and a tuple in Python", "RAM and disk storage", "a crocodile and an alligator",
    "stocks and bonds", "baking soda and baking powder", "a meteor and a meteorite", "speed and velocity",
    "HTTP and HTTPS", "a lake and a pond", "a frog and a toad", "tea and coffee", "affect and effect",
    "a debit card and a credit card", "a hurricane and a tornado", "mitosis and meiosis",
    "an atom and a molecule", "a simile and a metaphor", "renting and buying a home", "a CPU and a GPU",
    "weight and mass", "a democracy and a monarchy", "a dolphin and a shark", "a loan and a grant",
]
TERMS = [
    "irony", "opportunity cost", "biodiversity", "empathy", "latency", "a verb", "entropy",
    "a carbon footprint", "nostalgia", "a mortgage", "GDP", "a palindrome", "an ecosystem", "osmosis",
    "a variable in programming", "a metaphor", "bandwidth", "a dividend", "an allergy", "a glacier",
    "an idiom", "a prime number", "a synonym", "a fossil", "a tariff", "a thesis statement",
]
WHY = [
    "do cats purr", "does bread go stale", "do leaves change color", "is the ocean salty", "do we dream",
    "do onions make people cry", "does ice float on water", "do we yawn", "do stars twinkle", "do birds migrate",
    "does the moon look bigger near the horizon", "do we get goosebumps", "do computers need fans",
    "do airplanes leave white trails", "do some people snore", "does metal feel colder than wood",
    "do we need vitamin D", "does popcorn pop", "do dogs wag their tails", "is exercise good for the brain",
]
HOW_DOES = [
    "a refrigerator keep food cold", "a rainbow form", "the heart pump blood", "a vaccine protect us",
    "Wi-Fi work", "a battery store energy", "GPS find my position", "a microwave heat food",
    "an airplane stay in the air", "the body fight a cold", "soap remove dirt", "a camera take a picture",
    "a bicycle stay upright", "a thermometer measure temperature", "the moon cause tides", "a lock and key work",
]
HISTORY = [
    "the story of the Roman Empire", "the Industrial Revolution", "the Cold War", "the first Moon landing",
    "the invention of the telephone", "the history of the Olympic Games", "life in ancient Egypt",
    "the Wright brothers' first flight", "the building of the Great Wall of China", "the invention of paper",
    "the history of chess", "the age of exploration", "the French Revolution", "the fall of the Berlin Wall",
    "the invention of the computer", "the discovery of electricity", "the first vaccines", "the Viking age",
    "the rise of the Internet", "the history of coffee",
]
SCENES = ["a busy market", "a rainy morning", "a quiet forest", "a snowy village", "a crowded train station",
          "the view from a mountain top", "an empty beach in winter", "a kitchen on a holiday morning",
          "a library at closing time", "a thunderstorm over a field", "a street festival", "an abandoned factory",
          "a school yard at noon", "a harbour at dusk"]
COUNTRIES = ["Spain", "Canada", "Japan", "Kenya", "Brazil", "Norway", "Egypt", "Australia", "Peru", "Vietnam",
             "Italy", "Mexico", "India", "Germany", "Morocco", "Chile", "Thailand", "Poland", "Ireland", "Ghana"]
FACTS = [
    "Who wrote Romeo and Juliet?", "How far away is the Moon?", "At what temperature does water freeze in Fahrenheit?",
    "When did people first walk on the Moon?", "What is the tallest mountain in Africa?",
    "How many bones does an adult human have?", "Which language do people speak in Brazil?",
    "Who painted the Mona Lisa?", "What is the chemical symbol for gold?", "How long is a marathon?",
    "What is the longest river in Europe?", "How many continents are there?", "How fast does sound travel in air?",
    "Which ocean is the deepest?", "What currency does Japan use?", "How many hearts does an octopus have?",
    "Who invented the light bulb?", "What is the smallest country in the world?", "How old is the universe?",
    "What is the hottest planet?", "How many players are on a football team?", "Who discovered penicillin?",
    "What is the hardest natural material?", "How many minutes are in a day?", "Where is Mount Everest?",
    "What gas do humans breathe out?", "Who was the first president of the United States?",
    "What is the freezing point of water in Celsius?", "How many strings does a violin have?",
]
CODE_TASKS = [
    "returns the largest of three numbers", "checks whether a word is a palindrome", "counts the vowels in a string",
    "adds up the even numbers in a list", "converts Celsius to Fahrenheit", "removes duplicates from a list",
    "returns the n-th Fibonacci number", "checks whether a year is a leap year", "finds the longest word in a sentence",
    "counts how often each word appears in a text", "merges two sorted lists", "returns the average of a list",
    "checks whether a number is prime", "capitalizes every word in a sentence", "flattens a nested list",
    "converts a number of seconds to hours and minutes", "reads a text file and counts its lines",
    "returns the second largest number in a list", "checks whether two words are anagrams",
    "validates a simple email address", "builds a dictionary from two lists",
]
GOALS = ["get fitter", "learn basic Spanish", "eat more vegetables", "read a novel", "learn to cook five dishes",
         "clean out the garage", "prepare for a 5k run", "learn the basics of Python", "sleep on a regular schedule",
         "write a short story", "learn to draw faces", "cut down on sugar", "redecorate a bedroom",
         "pass a driving test"]
TRIPS = ["a beach holiday", "a business trip", "a ski weekend", "a camping trip with children",
         "a city break in winter",
         "a week in Iceland", "a music festival", "a long flight with a baby", "a cycling tour",
         "a visit to my grandparents"]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a handmade candle", "a wooden chess set",
            "a folding bicycle", "a smart alarm clock", "a rain jacket for hikers", "a cast-iron pan", "a desk lamp",
            "organic dog treats", "a beginner's watercolor kit", "a solar phone charger"]
OCCASIONS = ["a friend's wedding", "a colleague's retirement", "a school graduation", "a team's project launch",
             "my parents' anniversary", "a farewell dinner", "a new year's party", "my sister's 30th birthday"]
READERS = ["my landlord", "a teacher", "my team", "a new neighbour", "a customer", "my manager", "a supplier",
           "the school principal"]
MATTERS = ["a broken heater", "a missed deadline", "a change of schedule", "a thank-you for their help",
           "a late payment", "a noisy party next weekend", "a day off next Friday", "a new project idea"]
OPTIONS = ["working from home", "electric cars", "online classes", "living in a big city", "owning a dog",
           "solar panels on a house", "freelancing", "e-books", "a four-day work week", "learning to code on my own",
           "renting a car abroad", "a gap year", "a standing desk", "buying a used phone", "living alone"]
BOOK_TOPICS = ["space", "World War II", "habits", "cooking", "the ocean", "personal finance", "dinosaurs",
               "leadership", "ancient Greece", "psychology", "gardening", "startups", "climate", "mathematics"]

KINDS: dict[str, list[str]] = {
    "fact": ["{fact}", "What is the capital city of {country}?", "Roughly how many people live in {country}?",
             "What is {country} famous for?"],
    "explain": ["Explain {concept} in simple terms.", "Can you explain {concept} to a beginner?",
                "Explain {concept} in a short paragraph.", "Give me a simple explanation of {concept}.",
                "I don't understand {concept}. Can you help?"],
    "list": ["List {n} {plural}.", "Name {n} {plural}.", "Give me {n} {plural}.", "What are some {plural}?"],
    "how_to": ["How do I {task}?", "What's the easiest way to {task}?", "Can you tell me how to {task}?",
               "Give me step-by-step instructions to {task}."],
    "creative": ["Write {form} about {subject}.", "Can you write {form} about {subject}?",
                 "Compose {form} about {subject}."],
    "advice": ["Give me {n} tips for {advice}.", "Any advice for {advice}?",
               "What should I keep in mind when I {task}?",
               "I need help with {advice}. What do you suggest?"],
    "naming": ["Suggest a name for {named}.", "Give me {n} name ideas for {named}.",
               "What would be a good name for {named}?", "Help me name {named}."],
    "compare": ["What is the difference between {pair}?", "Compare {pair}.", "How do {pair} differ?",
                "What do {pair} have in common?"],
    "define": ["Define {term}.", "What does {term} mean?", "What is meant by {term}?",
               "Give a simple definition of {term}.", "What is {term}? Give an example."],
    "why": ["Why {why}?", "Why {why}? Please keep it simple.", "How does {how}?", "How does {how}? Explain briefly."],
    "summary": ["Summarize {history} in a few sentences.", "Give a short overview of {history}.",
                "Tell me briefly about {history}."],
    "describe": ["Describe {scene} in {n} sentences.", "Paint a picture of {scene} with words.",
                 "Describe {scene} for a story I am writing."],
    "writing": ["Write a short email to {reader} about {matter}.", "Write a product description for {product}.",
                "Write a short toast for {occasion}.", "Write a catchy slogan for {named}."],
    "code": ["Write a Python function that {code}.", "Show me Python code that {code}.",
             "How would I write a function in Python that {code}?"],
    "plan": ["Make a {n}-day plan to {goal}.", "Write a packing list for {trip}.", "Help me plan how to {goal}."],
    "recommend": ["Recommend {n} books about {books}.", "What are the pros and cons of {option}?",
                  "What book or podcast would you recommend about {books}?"],
}
SLOTS: dict[str, list[str]] = {
    "n": NUMBERS, "concept": CONCEPTS, "task": TASKS, "plural": PLURALS, "form": POEM_FORMS, "subject": POEM_SUBJECTS,
    "advice": ADVICE_FOR, "named": NAMED_THINGS, "pair": PAIRS, "term": TERMS, "why": WHY, "how": HOW_DOES,
    "history": HISTORY, "scene": SCENES, "country": COUNTRIES, "fact": FACTS, "code": CODE_TASKS, "goal": GOALS,
    "trip": TRIPS, "product": PRODUCTS, "occasion": OCCASIONS, "reader": READERS, "matter": MATTERS,
    "books": BOOK_TOPICS, "option": OPTIONS,
}

# The target writes the other share of the questions: one request of a kind, about a topic.
WRITER_KINDS = ["a short factual question", "a request to explain something", "a request for a list",
                "a how-to question", "a request for a short poem or story", "a request for advice",
                "a request for name ideas", "a question comparing two things", "a why-question",
                "a request to summarize a subject", "a request to write a short message", "a request for a plan"]
WRITER_TOPICS = [
    "cooking", "history", "physics", "programming in Python", "travel", "music", "health", "gardening",
    "mathematics", "economics", "email writing", "biology", "chemistry", "sports", "movies", "pets", "astronomy",
    "personal finance", "job interviews", "learning languages", "the weather", "cars", "databases", "poetry",
    "philosophy", "geography", "electricity", "computers", "painting", "fitness", "nutrition", "home repair",
    "parenting", "fashion", "photography", "board games", "architecture", "the ocean", "insects", "trains",
    "careers", "mental health", "law", "marketing", "statistics", "web design", "religions of the world",
    "recycling", "birds", "weddings", "camping", "smartphones", "video games", "dinosaurs", "coffee",
]
WRITER_SEED = "Write {kind} that a person might type into a chat assistant about {topic}. Reply with the request only."
# fmt: on


def fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def fill(template: str, rng: random.Random) -> str:
    return template.format(**{name: rng.choice(SLOTS[name]) for name in fields(template)})


def dealt_kinds(count: int, rng: random.Random) -> list[str]:
    """count kinds, round robin over shuffled orders: each kind count // len(KINDS) times or once more."""
    out: list[str] = []
    while len(out) < count:
        order = sorted(KINDS)
        rng.shuffle(order)
        out += order[: count - len(out)]
    return out


def template_requests(count: int, seed: int) -> list[tuple[str, str]]:
    """count (kind, request) pairs from our templates; a request already drawn is drawn again (up to
    20 times), so repeats come only once a kind's expansions run short."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    for kind in dealt_kinds(count, rng):
        for _ in range(20):
            text = fill(rng.choice(KINDS[kind]), rng)
            if text not in seen:
                break
        seen.add(text)
        out.append((kind, text))
    return out


def writer_asks(count: int, seed: int) -> list[str]:
    """count instructions for the target to write one request each (kinds dealt round robin)."""
    rng = random.Random(seed)
    kinds = [WRITER_KINDS[i % len(WRITER_KINDS)] for i in range(count)]
    rng.shuffle(kinds)
    return [WRITER_SEED.format(kind=kind, topic=rng.choice(WRITER_TOPICS)) for kind in kinds]


def every_template_request():
    """Every request the templates can produce (each template over every combination of its slots)."""
    for templates in KINDS.values():
        for template in templates:
            names = fields(template)
            for values in itertools.product(*(SLOTS[n] for n in names)):
                yield template.format(**dict(zip(names, values)))
