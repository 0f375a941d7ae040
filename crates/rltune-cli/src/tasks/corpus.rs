//! A synthetic movie-review corpus: varied sentences, each review labelled positive or negative.
//!
//! The quickstart needs an IMDB-like task offline. Reviews are built from templates with slots
//! (titles, genres, people, aspects, adjectives, intensifiers) in several sentence shapes, 2–5
//! sentences long. A review's label is its overall sentiment: most sentences agree with it, some
//! reviews concede a point of the other polarity ("the score was dull, but …"), and the closing
//! sentence always carries the verdict. Generation is deterministic given the seed.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// One review and its label.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Review {
    /// The review text.
    pub text: String,
    /// True for a positive review.
    pub positive: bool,
}

const TITLES: &[&str] = &[
    "The Last Harbor",
    "Midnight Orchard",
    "Glass Kingdom",
    "The Quiet Engine",
    "Paper Moons",
    "Red Canyon",
    "The Long Winter",
    "Silver Lining Road",
    "Northern Lights",
    "The Clockmaker",
    "Hollow Street",
    "Blue Summit",
    "The Ninth Door",
    "Wild Rivers",
    "Echo Park Nights",
    "The Iron Garden",
    "Lost in Lisbon",
    "Starfall",
    "The Lighthouse Keeper",
    "Crimson Tide Rising",
    "A Small Miracle",
    "The Forgotten Road",
    "Salt and Smoke",
    "Desert Bloom",
    "City of Kites",
];
const GENRES: &[&str] = &[
    "drama",
    "comedy",
    "thriller",
    "western",
    "mystery",
    "romance",
    "horror film",
    "science fiction story",
    "war film",
    "family film",
    "musical",
    "documentary",
    "crime story",
    "adventure",
];
const PEOPLE: &[&str] = &[
    "the director",
    "the lead actress",
    "the lead actor",
    "the writer",
    "the cast",
    "the young star",
    "the supporting cast",
    "the composer",
    "the cinematographer",
    "the villain",
];
const ASPECTS: &[&str] = &[
    "the story",
    "the acting",
    "the script",
    "the dialogue",
    "the ending",
    "the soundtrack",
    "the pacing",
    "the photography",
    "the plot",
    "the characters",
    "the humor",
    "the final act",
    "the editing",
    "the special effects",
    "the score",
];
const POS_ADJ: &[&str] = &[
    "wonderful",
    "brilliant",
    "moving",
    "beautiful",
    "charming",
    "gripping",
    "delightful",
    "superb",
    "excellent",
    "funny",
    "clever",
    "touching",
    "stunning",
    "powerful",
    "fresh",
    "memorable",
    "warm",
];
const NEG_ADJ: &[&str] = &[
    "boring",
    "dull",
    "awful",
    "clumsy",
    "tedious",
    "lifeless",
    "predictable",
    "weak",
    "terrible",
    "messy",
    "flat",
    "forgettable",
    "silly",
    "painful",
    "confusing",
    "lazy",
    "cheap",
];
const INTENS: &[&str] =
    &["", "", "really ", "truly ", "very ", "simply ", "quite ", "incredibly ", "rather "];
const POS_VERDICT: &[&str] = &[
    "I loved every minute of it.",
    "Highly recommended.",
    "I would watch it again tomorrow.",
    "One of the best films of the year.",
    "Go and see it.",
    "It deserves every award it gets.",
    "A real pleasure from start to finish.",
    "I left the cinema smiling.",
    "Ten out of ten.",
];
const NEG_VERDICT: &[&str] = &[
    "I would not recommend it.",
    "A complete waste of time.",
    "I almost walked out.",
    "One of the worst films of the year.",
    "Skip this one.",
    "I want my two hours back.",
    "A real disappointment from start to finish.",
    "I left the cinema bored.",
    "Two out of ten.",
];

fn pick<'a, R: Rng>(rng: &mut R, xs: &[&'a str]) -> &'a str {
    xs.choose(rng).copied().unwrap_or("")
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

/// One sentence of the given polarity.
fn sentence<R: Rng>(rng: &mut R, positive: bool) -> String {
    let adj = |rng: &mut R| pick(rng, if positive { POS_ADJ } else { NEG_ADJ });
    let (a, i, asp) = (adj(rng), pick(rng, INTENS), pick(rng, ASPECTS));
    match rng.gen_range(0..8) {
        0 => format!("{} was {i}{a}.", capitalize(asp)),
        1 => format!("I thought {} was {i}{a}.", pick(rng, PEOPLE)),
        2 => format!("{} is a {i}{a} {}.", pick(rng, TITLES), pick(rng, GENRES)),
        3 => format!("The work of {} felt {i}{a} throughout.", pick(rng, PEOPLE)),
        4 => {
            let b = adj(rng);
            format!("{} was {a} and {} was {b}.", capitalize(asp), pick(rng, ASPECTS))
        }
        5 => format!("What a {i}{a} {}.", pick(rng, GENRES)),
        6 => format!("Honestly, {asp} was {i}{a}."),
        _ => format!("This {} has {i}{a} moments and {a} {}.", pick(rng, GENRES), pick(rng, ASPECTS)),
    }
}

/// A review of the given polarity, 2–5 sentences, sometimes with a concession.
pub fn review<R: Rng>(rng: &mut R, positive: bool) -> String {
    let n = rng.gen_range(1..=3);
    let mut parts = vec![format!("I watched {} last night.", pick(rng, TITLES))];
    if rng.gen_bool(0.5) {
        parts.clear();
    }
    for _ in 0..n {
        parts.push(sentence(rng, positive));
    }
    if rng.gen_bool(0.25) {
        let other = sentence(rng, !positive);
        let other = other.trim_end_matches('.');
        let main = sentence(rng, positive);
        let lower = main.chars().next().map(|c| c.to_lowercase().collect::<String>()).unwrap_or_default()
            + &main.chars().skip(1).collect::<String>();
        parts.push(format!("{other}, but {lower}"));
    }
    parts.push(pick(rng, if positive { POS_VERDICT } else { NEG_VERDICT }).to_string());
    parts.join(" ")
}

/// `n` reviews, half positive, shuffled, from `seed`.
pub fn generate_corpus(n: usize, seed: u64) -> Vec<Review> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out: Vec<Review> = (0..n)
        .map(|i| {
            let positive = i % 2 == 0;
            Review { text: review(&mut rng, positive), positive }
        })
        .collect();
    out.shuffle(&mut rng);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn corpus_is_deterministic_balanced_and_varied() {
        let a = generate_corpus(2000, 7);
        assert_eq!(a, generate_corpus(2000, 7));
        let pos = a.iter().filter(|r| r.positive).count();
        assert_eq!(pos, 1000);
        let distinct: HashSet<&str> = a.iter().map(|r| r.text.as_str()).collect();
        assert!(distinct.len() > 1990, "only {} distinct reviews", distinct.len());
        assert!(a.iter().all(|r| r.text.ends_with('.') && r.text.len() > 20));
    }

    #[test]
    fn labels_follow_the_verdict() {
        for r in generate_corpus(500, 1) {
            let verdicts = if r.positive { POS_VERDICT } else { NEG_VERDICT };
            assert!(verdicts.iter().any(|v| r.text.ends_with(v)), "{r:?}");
        }
    }
}
