//! Word lists and the texts the player reads: room descriptions, feedback, inventory.
//!
//! The lists are small on purpose: the policy is a tiny GPT-2 with a few hundred tokens of
//! context, so names are one or two short words and a room fits in two or three sentences.

use super::world::{Command, DoorState, Kind, Loc, State, World};

/// Room names (also the most rooms a game can have).
pub(super) const ROOMS: [&str; 12] = [
    "kitchen", "study", "cellar", "pantry", "attic", "garden", "hallway", "bedroom", "library", "workshop",
    "bathroom", "parlour",
];

/// One sentence of colour per room.
pub(super) const FLAVOURS: [&str; 8] = [
    "It smells of dust.",
    "The floor creaks.",
    "It is quiet here.",
    "A draught blows through.",
    "The walls are bare.",
    "It is rather dark.",
    "Sunlight falls in.",
    "It feels cosy.",
];

/// Adjectives of portable items.
pub(super) const ADJECTIVES: [&str; 10] =
    ["golden", "red", "old", "tiny", "blue", "silver", "green", "shiny", "heavy", "black"];

/// Nouns of portable items (at most one item per noun in a game).
pub(super) const ITEMS: [&str; 14] = [
    "coin", "book", "candle", "cup", "lamp", "ring", "scroll", "spoon", "map", "hat", "bottle", "feather",
    "bell", "glove",
];

/// Nouns of the trap's food ("rotten apple").
pub(super) const FOODS: [&str; 4] = ["apple", "pear", "fish", "cheese"];

/// Furniture: supporters take things "on", containers "in" (containers are always open).
pub(super) const FURNITURE: [(&str, Kind); 10] = [
    ("table", Kind::Supporter),
    ("shelf", Kind::Supporter),
    ("bench", Kind::Supporter),
    ("desk", Kind::Supporter),
    ("counter", Kind::Supporter),
    ("chest", Kind::Container),
    ("box", Kind::Container),
    ("crate", Kind::Container),
    ("basket", Kind::Container),
    ("cabinet", Kind::Container),
];

/// Metals of keys ("brass key").
pub(super) const KEY_METALS: [&str; 4] = ["brass", "iron", "copper", "rusty"];

/// Materials of doors ("oak door"); at least `ROOMS.len() - 1` (a tree's edges).
pub(super) const DOOR_MATERIALS: [&str; 12] =
    ["wooden", "iron", "oak", "red", "green", "glass", "blue", "white", "black", "pine", "steel", "yellow"];

/// What examining an ordinary item says.
pub(super) const ITEM_LOOKS: [&str; 4] =
    ["It looks ordinary.", "It is a little worn.", "Nothing special about it.", "It has seen better days."];

/// "a coin", "an old book".
pub(super) fn with_article(name: &str) -> String {
    let an = name.starts_with(['a', 'e', 'i', 'o', 'u']);
    format!("{} {name}", if an { "an" } else { "a" })
}

/// "x", "x and y", "x, y and z".
pub(super) fn join(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().chain(c).collect()).unwrap_or_default()
}

/// Names of the objects at `loc`, with articles, in a fixed order.
fn names_at(world: &World, state: &State, loc: Loc) -> Vec<String> {
    world
        .objects
        .iter()
        .zip(&state.locs)
        .filter(|(_, l)| **l == loc)
        .map(|(o, _)| with_article(&o.name))
        .collect()
}

/// "On the table you see a coin." / "The chest is empty."
fn contents(world: &World, state: &State, furniture: usize) -> String {
    let f = &world.objects[furniture];
    let inside = names_at(world, state, Loc::In(furniture));
    if inside.is_empty() {
        format!("The {} is empty.", f.name)
    } else {
        format!("{} the {} you see {}.", capitalized(f.kind.preposition()), f.name, join(&inside))
    }
}

/// The room the player is in: title, colour, what lies about, exits.
pub(super) fn describe_room(world: &World, state: &State) -> String {
    let room = &world.rooms[state.room];
    let mut out = format!("-= {} =-\nYou are in the {}. {}", capitalized(room.name), room.name, room.flavour);
    let floor = names_at(world, state, Loc::Floor(state.room));
    if !floor.is_empty() {
        out += &format!(" You see {}.", join(&floor));
    }
    for (i, o) in world.objects.iter().enumerate() {
        if o.kind.is_furniture()
            && state.locs[i] == Loc::Floor(state.room)
            && state.locs.contains(&Loc::In(i))
        {
            out += " ";
            out += &contents(world, state, i);
        }
    }
    let mut plain = Vec::new();
    for (d, exit) in room.exits() {
        match exit.door {
            None => plain.push(d.name().to_string()),
            Some(k) => {
                let open = if state.doors[k] == DoorState::Open { "an open" } else { "a closed" };
                out += &format!(" There is {open} {} to the {}.", world.doors[k].name, d.name());
            }
        }
    }
    if !plain.is_empty() {
        out += &format!(" You can go {}.", join(&plain));
    }
    out
}

/// "You are carrying: a brass key." or "You are carrying nothing."
pub(super) fn inventory(world: &World, state: &State) -> String {
    let held = names_at(world, state, Loc::Held);
    if held.is_empty() {
        "You are carrying nothing.".into()
    } else {
        format!("You are carrying: {}.", join(&held))
    }
}

/// What the game says after `cmd` was applied (`state` is the state after it).
pub(super) fn feedback(world: &World, state: &State, cmd: Command) -> String {
    let obj = |i: usize| world.objects[i].name.as_str();
    let door = |k: usize| world.doors[k].name.as_str();
    match cmd {
        Command::Look | Command::Go(_) => describe_room(world, state),
        Command::Inventory => inventory(world, state),
        Command::Take(i) => format!("You pick up the {}.", obj(i)),
        Command::TakeFrom(i, f) => format!("You take the {} from the {}.", obj(i), obj(f)),
        Command::Drop(i) => format!("You drop the {}.", obj(i)),
        Command::Put(i, f) => {
            format!("You put the {} {} the {}.", obj(i), world.objects[f].kind.preposition(), obj(f))
        }
        Command::Open(k) => format!("You open the {}.", door(k)),
        Command::Close(k) => format!("You close the {}.", door(k)),
        Command::Unlock(k, _) => format!("You unlock the {}.", door(k)),
        Command::Lock(k, _) => format!("You lock the {}.", door(k)),
        Command::Eat(i) => format!("You eat the {}. It was poisonous.", obj(i)),
        Command::ExamineDoor(k) => {
            let how = match state.doors[k] {
                DoorState::Open => "open",
                DoorState::Closed => "closed",
                DoorState::Locked => "closed and locked",
            };
            format!("The {} is {how}.", door(k))
        }
        Command::ExamineObject(i) => match world.objects[i].kind {
            Kind::Supporter | Kind::Container => contents(world, state, i),
            Kind::Key(k) => format!("The {} fits the {}.", obj(i), door(k)),
            Kind::Rotten => format!("The {} smells awful.", obj(i)),
            Kind::Item => world.objects[i].looks.to_string(),
        },
    }
}

impl World {
    /// The whole game as text, for debugging and determinism tests.
    pub(super) fn describe(&self) -> String {
        let mut out = String::new();
        for (r, room) in self.rooms.iter().enumerate() {
            let exits: Vec<String> = room
                .exits()
                .map(|(d, e)| match e.door {
                    Some(k) => format!("{} -> {} ({})", d.name(), self.rooms[e.to].name, self.doors[k].name),
                    None => format!("{} -> {}", d.name(), self.rooms[e.to].name),
                })
                .collect();
            out += &format!("room {r} {}: {}\n", room.name, exits.join(", "));
        }
        for (i, o) in self.objects.iter().enumerate() {
            out += &format!("object {i} {} ({:?}) at {:?}\n", o.name, o.kind, self.start.locs[i]);
        }
        for (k, d) in self.doors.iter().enumerate() {
            out += &format!("door {k} {} {:?}\n", d.name, self.start.doors[k]);
        }
        out += &format!("start in {}\nquest {:?}\n", self.rooms[self.start.room].name, self.quest);
        out += &format!("first view: {}\n", describe_room(self, &self.start));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_read_like_english() {
        assert_eq!(join(&[]), "");
        assert_eq!(join(&["a".into()]), "a");
        assert_eq!(join(&["a".into(), "b".into(), "c".into()]), "a, b and c");
        assert_eq!(with_article("old book"), "an old book");
        assert_eq!(with_article("coin"), "a coin");
        assert!(DOOR_MATERIALS.len() + 1 >= ROOMS.len());
    }
}
