"""Built-in word lists for the synthetic tasks (category questions, keys, names, filler).

Every word belongs to exactly one category (no word fits two of the questions asked), so a
category question has exactly one right option. ``split_words`` deals each category's words into
DISJOINT ``train`` and ``test`` halves (every third word, in list order, is a test word), so a toy
model trained on ``split=train`` prompts is tested on words it has never seen as options.
"""
from __future__ import annotations

# category -> (question noun phrase, words). Words are common, lower-case (proper nouns capitalised) and unambiguous across
# categories (no "orange"/"turkey"/"organ"/"nail"/"coach"/"chest"/"plane"/"bass").
CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fruit": ("a fruit", (
        "apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum", "melon",
        "kiwi", "lime", "apricot", "papaya", "guava", "fig", "coconut", "pineapple", "raspberry",
        "strawberry", "blueberry", "watermelon", "nectarine", "tangerine", "pomegranate", "lychee",
        "cranberry", "quince", "persimmon", "grapefruit", "blackberry", "mandarin", "avocado")),
    "vegetable": ("a vegetable", (
        "carrot", "potato", "onion", "cabbage", "lettuce", "spinach", "broccoli", "celery",
        "cucumber", "pumpkin", "radish", "turnip", "garlic", "pea", "bean", "leek", "beet", "kale",
        "zucchini", "eggplant", "cauliflower", "asparagus", "artichoke", "parsnip", "okra",
        "yam", "shallot", "chard", "arugula", "rhubarb", "sprout", "corn", "squash")),
    "animal": ("an animal", (
        "dog", "cat", "horse", "cow", "sheep", "goat", "pig", "lion", "tiger", "bear", "wolf", "fox",
        "rabbit", "mouse", "deer", "elephant", "giraffe", "zebra", "monkey", "camel", "donkey",
        "kangaroo", "koala", "panda", "leopard", "cheetah", "hippo", "rhino", "squirrel", "otter",
        "badger", "hedgehog", "moose")),
    "vehicle": ("a vehicle", (
        "car", "bus", "truck", "bicycle", "motorcycle", "train", "tram", "van", "taxi", "scooter",
        "tractor", "ambulance", "helicopter", "airplane", "boat", "ship", "yacht", "canoe", "kayak",
        "submarine", "rocket", "wagon", "sled", "jeep", "limousine", "minibus", "ferry", "trolley",
        "caravan", "moped", "tanker", "bulldozer", "glider")),
    "furniture": ("a piece of furniture", (
        "chair", "table", "sofa", "bed", "desk", "shelf", "stool", "bench", "wardrobe", "dresser",
        "cupboard", "couch", "armchair", "bookcase", "cradle", "crib", "ottoman", "sideboard",
        "hammock", "futon", "recliner", "cabinet", "nightstand", "footstool", "rocker", "divan",
        "loveseat", "bunk", "vanity", "hutch", "credenza", "throne", "settee")),
    "tool": ("a tool", (
        "hammer", "saw", "drill", "wrench", "screwdriver", "pliers", "chisel", "shovel", "rake",
        "axe", "spade", "trowel", "crowbar", "file", "level", "clamp", "mallet", "hoe", "sickle",
        "scythe", "pickaxe", "sander", "grinder", "vise", "awl", "plunger", "ladder", "tape",
        "scissors", "shears", "spanner", "hatchet", "mattock")),
    "instrument": ("a musical instrument", (
        "piano", "guitar", "violin", "cello", "flute", "trumpet", "drum", "harp", "clarinet",
        "saxophone", "trombone", "tuba", "banjo", "ukulele", "mandolin", "harmonica", "accordion",
        "oboe", "bassoon", "xylophone", "tambourine", "bagpipe", "sitar", "lute", "viola", "cymbal",
        "piccolo", "harpsichord", "marimba", "bugle", "zither", "triangle", "recorder")),
    "body": ("a part of the body", (
        "arm", "leg", "hand", "foot", "head", "knee", "elbow", "shoulder", "finger", "toe", "ear",
        "nose", "mouth", "eye", "neck", "wrist", "ankle", "hip", "thumb", "lip", "tongue", "tooth",
        "heel", "chin", "cheek", "forehead", "eyebrow", "stomach", "liver", "lung", "kidney",
        "spine", "skull")),
    "country": ("a country", (
        "France", "Germany", "Spain", "Italy", "Japan", "China", "India", "Brazil", "Canada",
        "Mexico", "Egypt", "Kenya", "Peru", "Chile", "Norway", "Sweden", "Finland", "Poland",
        "Greece", "Portugal", "Ireland", "Austria", "Belgium", "Denmark", "Russia", "Vietnam",
        "Thailand", "Nigeria", "Morocco", "Argentina", "Colombia", "Iceland", "Hungary")),
    "city": ("a city", (
        "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Moscow", "Cairo", "Sydney",
        "Toronto", "Chicago", "Boston", "Dublin", "Vienna", "Prague", "Lisbon", "Athens", "Oslo",
        "Stockholm", "Helsinki", "Warsaw", "Budapest", "Amsterdam", "Brussels", "Seoul", "Beijing",
        "Shanghai", "Mumbai", "Delhi", "Lagos", "Nairobi", "Lima", "Havana")),
    "job": ("a job", (
        "doctor", "nurse", "teacher", "lawyer", "farmer", "baker", "butcher", "pilot", "chef",
        "plumber", "carpenter", "dentist", "engineer", "architect", "banker", "journalist", "judge",
        "painter", "sailor", "soldier", "tailor", "waiter", "cashier", "librarian", "mechanic",
        "electrician", "pharmacist", "surgeon", "firefighter", "accountant", "gardener", "miner",
        "plasterer")),
    "clothing": ("an item of clothing", (
        "shirt", "trousers", "jacket", "coat", "dress", "skirt", "sweater", "hat", "scarf", "glove",
        "sock", "shoe", "boot", "sandal", "blouse", "vest", "hoodie", "jeans", "shorts", "pajamas",
        "tuxedo", "overcoat", "cardigan", "raincoat", "beret", "bonnet", "mitten", "apron",
        "kimono", "poncho", "slipper", "necktie", "bikini")),
    "sport": ("a sport", (
        "football", "tennis", "golf", "cricket", "rugby", "hockey", "baseball", "basketball",
        "volleyball", "swimming", "cycling", "skiing", "rowing", "sailing", "boxing", "wrestling",
        "fencing", "archery", "badminton", "netball", "surfing", "karate", "judo", "polo",
        "lacrosse", "handball", "softball", "bowling", "curling", "snowboarding", "diving",
        "gymnastics", "marathon")),
    "drink": ("a drink", (
        "water", "milk", "coffee", "tea", "juice", "lemonade", "beer", "wine", "cider", "soda",
        "cocoa", "whisky", "vodka", "rum", "gin", "brandy", "champagne", "smoothie", "milkshake",
        "espresso", "latte", "cappuccino", "sherry", "tequila", "sake", "kombucha", "mead",
        "cola", "bourbon", "lager", "ale", "stout", "eggnog")),
    "building": ("a kind of building", (
        "house", "church", "castle", "temple", "palace", "school", "hospital", "library", "museum",
        "factory", "barn", "cottage", "mansion", "tower", "stadium", "theatre", "cinema", "hotel",
        "prison", "warehouse", "mosque", "cathedral", "skyscraper", "bungalow", "chapel", "fortress",
        "lighthouse", "garage", "pavilion", "monastery", "cabin", "igloo", "pagoda")),
}

# Neutral modifiers for multi-word options ("the old apple", "my very small car"): none of them is
# a category word, and none hints at a category.
DETERMINERS: tuple[str, ...] = ("the", "my", "this", "that", "one", "our", "your", "his", "her", "some")
ADJECTIVES: tuple[str, ...] = (
    "small", "big", "old", "new", "nice", "cheap", "odd", "plain", "fine", "strange", "famous",
    "simple", "large", "tiny", "lovely", "quiet", "clean", "dirty", "heavy", "light", "shiny",
    "dusty", "rare", "common", "spare", "broken", "perfect", "ordinary", "lucky", "tall",
)

FIRST_NAMES: tuple[str, ...] = (
    "Jack", "David", "Leo", "Anna", "Maria", "Tom", "Sam", "Emma", "Lucy", "Paul", "Mark", "John",
    "Kate", "Mike", "Sara", "Ben", "Alex", "Nick", "Rose", "Lily", "Adam", "Eva", "Ivan", "Max",
    "Nina", "Omar", "Pete", "Ruth", "Tina", "Zoe", "Fred", "Hugo", "Iris", "Jane", "Karl", "Lisa",
)

# Plain filler for haystacks: repetitive, content-free sentences (written for this project).
FILLER_SENTENCES: tuple[str, ...] = (
    "The grass is green.", "The sky is blue.", "The sun is warm.", "Here we go again.",
    "There and back again.", "The road goes on and on.", "A bird sings in the tree.",
    "The river flows to the sea.", "Clouds drift over the hills.", "The day is long and quiet.",
)


def split_words(words: tuple[str, ...] | list[str], split: str) -> list[str]:
    """The ``train`` (two thirds), ``test`` (one third, disjoint) or ``all`` words of a list."""
    if split == "all":
        return list(words)
    test = [w for i, w in enumerate(words) if i % 3 == 2]
    if split == "test":
        return test
    if split == "train":
        return [w for i, w in enumerate(words) if i % 3 != 2]
    raise ValueError(f"unknown split {split!r}")


def category_words(split: str) -> dict[str, list[str]]:
    """Category name -> its words in ``split``."""
    return {name: split_words(words, split) for name, (_, words) in CATEGORIES.items()}
